#include "core/data/byte_tokenizer.h"

#include "core/util/error.h"

namespace weft {
namespace {

constexpr std::string_view kBeginOfTextText = "<|begin_of_text|>";
constexpr std::string_view kEndOfTextText = "<|end_of_text|>";

bool starts_with_at(std::string_view text, size_t pos, std::string_view prefix) {
  return text.compare(pos, prefix.size(), prefix) == 0;
}

}  // namespace

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    if (starts_with_at(text, i, kBeginOfTextText)) {
      ids.push_back(kBeginOfText);
      i += kBeginOfTextText.size();
    } else if (starts_with_at(text, i, kEndOfTextText)) {
      ids.push_back(kEndOfText);
      i += kEndOfTextText.size();
    } else {
      ids.push_back(static_cast<unsigned char>(text[i]));
      i += 1;
    }
  }
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string text;
  text.reserve(ids.size());
  for (int32_t id : ids) {
    if (id >= 0 && id < 256) {
      text += static_cast<char>(id);
    } else if (id == kBeginOfText) {
      text += kBeginOfTextText;
    } else if (id == kEndOfText) {
      text += kEndOfTextText;
    } else {
      fail("token id {} is out of range for the byte tokenizer (vocab size {})", id, kVocabSize);
    }
  }
  return text;
}

}  // namespace weft
