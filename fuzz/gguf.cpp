// fuzz_gguf: a GGUF file (the magic and version, the metadata, the tensor table, the data). Any
// input must open, or fail with weft::Error naming the file: GgufFile::open validates the whole
// header, after which every metadata read and every tensor of a type weft dequantizes must read
// without touching bytes outside the file.
#include <cstdint>
#include <vector>

#include "core/io/gguf.h"
#include "core/util/error.h"
#include "scratch.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = weft::fuzz::write_file("model.gguf", data, size);
  try {
    auto file = weft::GgufFile::open(path);
    for (const std::string& key : file->keys()) (void)file->value(key);
    (void)file->get_string("general.architecture");
    (void)file->get_int("llama.block_count");
    std::vector<float> values;
    for (const auto& tensor : file->tensors()) {
      if (!weft::ggml_type_dequantizable(tensor.type) || tensor.numel > (int64_t{1} << 22)) continue;
      values.resize(static_cast<size_t>(tensor.numel));
      file->dequantize(tensor, values.data());
    }
  } catch (const weft::Error&) {
  }
  return 0;
}
