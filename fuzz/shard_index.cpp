// fuzz_shard_index: a sharded checkpoint's shards/ folder (core/train/named_state.h): index.json,
// then a NUL byte, then rank-00000.safetensors, whose metadata places its pieces in whole tensors
// (an input without a NUL is the index alone, with no shard file). Any input must open and put
// every tensor together, or fail with weft::Error naming the file.
#include <cstdint>
#include <cstring>
#include <filesystem>

#include "core/train/named_state.h"
#include "core/util/error.h"
#include "scratch.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* nul = static_cast<const uint8_t*>(std::memchr(data, 0, size));
  const size_t index_size = nul != nullptr ? static_cast<size_t>(nul - data) : size;
  std::filesystem::remove_all(weft::fuzz::scratch_dir() + "/checkpoint");
  weft::fuzz::write_file("checkpoint/shards/index.json", data, index_size);
  if (nul != nullptr) weft::fuzz::write_file("checkpoint/shards/rank-00000.safetensors", nul + 1, size - index_size - 1);
  try {
    const auto state = weft::NamedState::open(weft::fuzz::scratch_dir() + "/checkpoint");
    for (const auto& name : state.names()) {
      (void)state.whole(name);
      (void)state.step(name);
    }
  } catch (const weft::Error&) {
  }
  return 0;
}
