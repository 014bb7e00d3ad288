// Quantizes every 2-D tensor of a safetensors file with weft's quantizers (core/model/quantize.h)
// and writes what weft stores, for the reference check against bitsandbytes
// (tools/quant_reference.py; built with the tests, run by ctest as Quantize.*):
//   quantize_dump int8|nf4 IN.safetensors OUT.safetensors
// OUT holds, for each input tensor NAME: NAME.data, NAME.scale (and for nf4 NAME.scale2,
// NAME.offset) as stored, and NAME.dequantized (fp32); and the code books nf4_code, dynamic_code.
#include <iostream>
#include <string>

#include <torch/torch.h>

#include "core/io/safetensors.h"
#include "core/model/quantize.h"
#include "core/util/error.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: quantize_dump int8|nf4 IN.safetensors OUT.safetensors\n";
    return 2;
  }
  try {
    const auto format = weft::parse_quant_format(argv[1]);
    WEFT_CHECK(format != weft::QuantFormat::kNone, "quantize_dump: int8 or nf4, not none");
    auto file = weft::SafetensorsFile::open(argv[2]);
    weft::NamedTensors out;
    for (const auto& info : file->tensors()) {
      const std::string& name = info.name;
      const auto weight = file->load(name, torch::kFloat32);
      if (weight.dim() != 2) continue;
      const auto q = weft::quantize_matrix(weight, format);
      out.emplace_back(name + ".data", q.data);
      out.emplace_back(name + ".scale", q.scale);
      if (q.scale2.defined()) out.emplace_back(name + ".scale2", q.scale2);
      if (q.offset.defined()) out.emplace_back(name + ".offset", q.offset);
      out.emplace_back(name + ".dequantized", q.dequantize(torch::kFloat32));
    }
    const auto& nf4 = weft::nf4_code();
    const auto& dynamic = weft::dynamic_code();
    out.emplace_back("nf4_code", torch::tensor(std::vector<float>(nf4.begin(), nf4.end())));
    out.emplace_back("dynamic_code", torch::tensor(std::vector<float>(dynamic.begin(), dynamic.end())));
    weft::save_safetensors(argv[3], out);
  } catch (const std::exception& e) {
    std::cerr << "quantize_dump: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
