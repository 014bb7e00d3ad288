// fuzz_tokenizer_json: a tokenizer.json as weft reads it (BPE vocab and merges, the pre-tokenizer
// and its regex, added tokens, decoder). A file that loads must then encode and decode text without
// fault; any other input must fail with weft::Error.
#include <cstdint>
#include <string>
#include <string_view>

#include "core/data/bpe_tokenizer.h"
#include "core/util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const weft::BpeTokenizer tokenizer(text, "fuzz/tokenizer.json");
    const auto ids = tokenizer.encode("It is a truth universally acknowledged, 1812 \xc3\xa9t\xc3\xa9!\n\n  <|eot|>");
    (void)tokenizer.decode(ids);
    (void)tokenizer.vocab_size();
    (void)tokenizer.fingerprint();
  } catch (const weft::Error&) {
  }
  return 0;
}
