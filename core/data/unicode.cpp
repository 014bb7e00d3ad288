#include "core/data/unicode.h"

#include <algorithm>
#include <array>
#include <iterator>

namespace weft::unicode {
namespace {

struct CodePointRange {
  uint32_t lo, hi;
};

#include "core/data/unicode_tables.inc"

template <size_t N>
bool in_ranges(const CodePointRange (&ranges)[N], uint32_t cp) {
  auto it = std::upper_bound(std::begin(ranges), std::end(ranges), cp,
                             [](uint32_t value, const CodePointRange& r) { return value < r.lo; });
  return it != std::begin(ranges) && cp <= std::prev(it)->hi;
}

bool is_continuation(unsigned char byte) { return (byte & 0xC0) == 0x80; }

// Length of the well-formed sequence starting at text[i] (Unicode Table 3-7), or 0.
size_t valid_sequence_length(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[i + k]); };
  const unsigned char lead = byte(0);
  if (lead < 0x80) return 1;
  size_t length = 0;
  unsigned char second_lo = 0x80, second_hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) second_lo = 0xA0;
    if (lead == 0xED) second_hi = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) second_lo = 0x90;
    if (lead == 0xF4) second_hi = 0x8F;
  } else {
    return 0;
  }
  if (i + length > text.size()) return 0;
  if (byte(1) < second_lo || byte(1) > second_hi) return 0;
  for (size_t k = 2; k < length; ++k)
    if (!is_continuation(byte(k))) return 0;
  return length;
}

uint32_t decode_sequence(std::string_view text, size_t i, size_t length) {
  const auto byte = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(text[i + k])); };
  static constexpr uint32_t kLeadMask[] = {0, 0x7F, 0x1F, 0x0F, 0x07};
  uint32_t cp = byte(0) & kLeadMask[length];
  for (size_t k = 1; k < length; ++k) cp = (cp << 6) | (byte(k) & 0x3F);
  return cp;
}

struct ByteCharTables {
  std::array<uint32_t, 256> byte_to_char{};
  std::array<int16_t, 512> char_to_byte{};  // every mapped code point is below U+0144
};

ByteCharTables make_byte_char_tables() {
  ByteCharTables tables;
  tables.char_to_byte.fill(-1);
  uint32_t next_unprintable = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : next_unprintable++;
    tables.byte_to_char[b] = cp;
    tables.char_to_byte[cp] = static_cast<int16_t>(b);
  }
  return tables;
}

const ByteCharTables& byte_char_tables() {
  static const ByteCharTables tables = make_byte_char_tables();
  return tables;
}

}  // namespace

std::vector<DecodedChar> decode_utf8_lenient(std::string_view text) {
  std::vector<DecodedChar> chars;
  chars.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const size_t length = valid_sequence_length(text, i);
    const uint32_t offset = static_cast<uint32_t>(i);
    if (length == 0) {
      chars.push_back({kInvalidBase + static_cast<unsigned char>(text[i]), offset, 1});
      i += 1;
    } else {
      chars.push_back({decode_sequence(text, i, length), offset, static_cast<uint32_t>(length)});
      i += length;
    }
  }
  return chars;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

bool is_letter(uint32_t cp) {
  if (cp < 0x80) return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
  return in_ranges(kLetterRanges, cp);
}

bool is_number(uint32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return in_ranges(kNumberRanges, cp);
}

bool is_white_space(uint32_t cp) {
  if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D);
  return in_ranges(kWhiteSpaceRanges, cp);
}

uint32_t byte_char(uint8_t byte) { return byte_char_tables().byte_to_char[byte]; }

int char_byte(uint32_t cp) {
  return cp < 512 ? byte_char_tables().char_to_byte[cp] : -1;
}

}  // namespace weft::unicode
