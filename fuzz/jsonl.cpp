// fuzz_jsonl: JSONL records (one object per line, the document in "text"). Any input must parse or
// fail with weft::Error naming the line.
#include <cstdint>
#include <string_view>

#include "core/data/documents.h"
#include "core/util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    (void)weft::parse_jsonl_documents(text, "fuzz.jsonl", "text");
  } catch (const weft::Error&) {
  }
  try {
    (void)weft::split_text_documents(text, weft::TextDocumentMode::kParagraph);
  } catch (const weft::Error&) {
  }
  return 0;
}
