// Every tensor of a GGUF file as weft dequantizes it, for the reference check against gguf-py and
// transformers (tools/gguf_reference.py; built with the tests, run by ctest as Reference.Gguf*):
//   gguf_tensors IN.gguf OUT.safetensors
// OUT holds each tensor of a type weft dequantizes, in fp32, under its GGUF name and in PyTorch's
// dimension order (GGUF stores the innermost first). Exit status 1 and one line on stderr when the
// file is refused.
#include <cstring>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "core/io/gguf.h"
#include "core/io/safetensors.h"
#include "core/util/error.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: gguf_tensors IN.gguf OUT.safetensors\n";
    return 2;
  }
  try {
    const auto file = weft::GgufFile::open(argv[1]);
    weft::NamedTensors tensors;
    for (const weft::GgufTensor& tensor : file->tensors()) {
      if (!weft::ggml_type_dequantizable(tensor.type)) continue;
      at::Tensor values = at::empty(tensor.shape, at::kFloat);
      file->dequantize(tensor, values.data_ptr<float>());
      tensors.emplace_back(tensor.name, values);
    }
    weft::save_safetensors(argv[2], tensors);
  } catch (const weft::Error& e) {
    std::cerr << "gguf_tensors: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
