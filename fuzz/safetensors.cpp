// fuzz_safetensors: a .safetensors file (the 8-byte header length, the JSON header with its tensor
// table and metadata, the data). Any input must open and read back, or fail with weft::Error
// naming the file: SafetensorsFile::open validates the whole header, after which every tensor and
// every slice of one must load without reading outside the file.
#include <cstdint>

#include "core/io/safetensors.h"
#include "core/util/error.h"
#include "scratch.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = weft::fuzz::write_file("model.safetensors", data, size);
  try {
    auto file = weft::SafetensorsFile::open(path);
    (void)file->metadata();
    for (const auto& info : file->tensors()) {
      (void)file->load(info.name, at::kFloat);
      if (!info.shape.empty() && info.shape[0] > 0) {
        (void)file->load_slice(info.name, 0, info.shape[0] / 2, info.shape[0] - info.shape[0] / 2);
      }
    }
  } catch (const weft::Error&) {
  }
  return 0;
}
