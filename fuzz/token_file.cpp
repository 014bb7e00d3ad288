// fuzz_token_file: pre-tokenized files (raw little-endian uint16 / uint32 ids) and their document
// boundaries. Any input must decode or fail with weft::Error (a ragged size, an id out of the vocab).
#include <cstdint>
#include <optional>
#include <string_view>

#include "core/data/documents.h"
#include "core/util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  for (const auto format : {weft::DataFormat::kTokensU16, weft::DataFormat::kTokensU32}) {
    try {
      const auto tokens = weft::decode_token_file(bytes, format, "fuzz.bin", 50000);
      (void)weft::token_document_offsets(tokens, tokens.empty() ? std::optional<int32_t>() : std::optional<int32_t>(static_cast<int32_t>(tokens.front())), 64);
    } catch (const weft::Error&) {
    }
  }
  return 0;
}
