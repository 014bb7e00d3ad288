#include "core/data/documents.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/util/error.h"

namespace weft {
namespace fs = std::filesystem;

namespace {

struct FormatName {
  DataFormat format;
  const char* name;
};
constexpr FormatName kFormatNames[] = {{DataFormat::kAuto, "auto"},
                                       {DataFormat::kText, "text"},
                                       {DataFormat::kJsonl, "jsonl"},
                                       {DataFormat::kTokensU16, "tokens-u16"},
                                       {DataFormat::kTokensU32, "tokens-u32"}};

struct ExtensionFormat {
  const char* extension;
  DataFormat format;
};
// The first entry for an extension is what "auto" picks.
constexpr ExtensionFormat kExtensions[] = {
    {".txt", DataFormat::kText},        {".text", DataFormat::kText},
    {".md", DataFormat::kText},         {".jsonl", DataFormat::kJsonl},
    {".json", DataFormat::kJsonl},      {".u16", DataFormat::kTokensU16},
    {".u32", DataFormat::kTokensU32},   {".bin", DataFormat::kTokensU32},
    {".bin", DataFormat::kTokensU16}};

std::string lowercase_extension(const std::string& path) {
  std::string ext = fs::path(path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return ext;
}

bool extension_belongs_to(const std::string& path, DataFormat format) {
  if (format == DataFormat::kAuto) return format_from_extension(path).has_value();
  const std::string ext = lowercase_extension(path);
  return std::any_of(std::begin(kExtensions), std::end(kExtensions),
                     [&](const ExtensionFormat& e) { return e.format == format && ext == e.extension; });
}

std::vector<InputFile> expand_directory(const std::string& dir, DataFormat format) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::error_code type_ec;
    if (name.empty() || name[0] == '.' || !it->is_regular_file(type_ec)) continue;
    if (extension_belongs_to(name, format)) names.push_back(name);
  }
  WEFT_CHECK(!ec, "cannot list dataset directory '{}': {}", dir, ec.message());
  WEFT_CHECK(!names.empty(), "dataset directory '{}' contains no {} files", dir,
             format == DataFormat::kAuto ? "known (.txt .text .md .jsonl .json .u16 .u32 .bin)"
                                         : data_format_name(format));
  std::sort(names.begin(), names.end());
  std::vector<InputFile> files;
  for (const auto& name : names) {
    const std::string path = (fs::path(dir) / name).string();
    files.push_back({path, format == DataFormat::kAuto ? *format_from_extension(path) : format});
  }
  return files;
}

bool is_blank(std::string_view line) {
  return std::all_of(line.begin(), line.end(), [](unsigned char c) { return std::isspace(c); });
}

// Calls on_line(start, end) for each line; [start, end) excludes the "\n" / "\r\n" terminator.
template <typename OnLine>
void for_each_line(std::string_view text, OnLine on_line) {
  size_t start = 0;
  while (start < text.size()) {
    size_t newline = text.find('\n', start);
    size_t next = newline == std::string_view::npos ? text.size() : newline + 1;
    size_t end = newline == std::string_view::npos ? text.size() : newline;
    if (end > start && text[end - 1] == '\r') --end;
    on_line(start, end);
    start = next;
  }
}

// "[json.exception.parse_error.101] parse error at ..." -> "parse error at ...".
std::string without_json_prefix(const std::string& what) {
  const size_t end = what.find("] ");
  return end == std::string::npos ? what : what.substr(end + 2);
}

const char* json_type_name(const nlohmann::json& value) { return value.type_name(); }

}  // namespace

DataFormat parse_data_format(const std::string& name) {
  for (const auto& entry : kFormatNames) {
    if (name == entry.name) return entry.format;
  }
  fail("unknown dataset format '{}' (use auto, text, jsonl, tokens-u16 or tokens-u32)", name);
}

std::string data_format_name(DataFormat format) {
  for (const auto& entry : kFormatNames) {
    if (format == entry.format) return entry.name;
  }
  return "?";
}

TextDocumentMode parse_text_document_mode(const std::string& name) {
  if (name == "file") return TextDocumentMode::kFile;
  if (name == "paragraph") return TextDocumentMode::kParagraph;
  if (name == "line") return TextDocumentMode::kLine;
  fail("unknown text_document mode '{}' (use file, paragraph or line)", name);
}

std::string text_document_mode_name(TextDocumentMode mode) {
  switch (mode) {
    case TextDocumentMode::kFile: return "file";
    case TextDocumentMode::kParagraph: return "paragraph";
    case TextDocumentMode::kLine: return "line";
  }
  return "?";
}

std::optional<DataFormat> format_from_extension(const std::string& path) {
  const std::string ext = lowercase_extension(path);
  for (const auto& entry : kExtensions) {
    if (ext == entry.extension) return entry.format;
  }
  return std::nullopt;
}

std::vector<InputFile> resolve_inputs(const std::vector<std::string>& paths, DataFormat format) {
  WEFT_CHECK(!paths.empty(), "dataset has no input paths");
  std::vector<InputFile> files;
  for (const auto& path : paths) {
    std::error_code ec;
    const auto status = fs::status(path, ec);
    WEFT_CHECK(fs::exists(status), "dataset path '{}' does not exist", path);
    if (fs::is_directory(status)) {
      for (auto& file : expand_directory(path, format)) files.push_back(std::move(file));
      continue;
    }
    if (format != DataFormat::kAuto) {
      files.push_back({path, format});
      continue;
    }
    const auto detected = format_from_extension(path);
    WEFT_CHECK(detected.has_value(),
               "dataset file '{}': cannot detect the format from its extension (known: .txt .text "
               ".md .jsonl .json .u16 .u32 .bin; or set the format explicitly)",
               path);
    files.push_back({path, *detected});
  }
  return files;
}

std::vector<std::string> split_text_documents(std::string_view text, TextDocumentMode mode) {
  std::vector<std::string> documents;
  if (mode == TextDocumentMode::kFile) {
    if (!is_blank(text)) documents.emplace_back(text);
    return documents;
  }
  if (mode == TextDocumentMode::kLine) {
    for_each_line(text, [&](size_t start, size_t end) {
      const auto line = text.substr(start, end - start);
      if (!is_blank(line)) documents.emplace_back(line);
    });
    return documents;
  }
  size_t doc_start = 0, doc_end = 0;
  bool in_document = false;
  auto flush = [&] {
    if (in_document) documents.emplace_back(text.substr(doc_start, doc_end - doc_start));
    in_document = false;
  };
  for_each_line(text, [&](size_t start, size_t end) {
    if (is_blank(text.substr(start, end - start))) return flush();
    if (!in_document) doc_start = start;
    in_document = true;
    doc_end = end;
  });
  flush();
  return documents;
}

void for_each_jsonl_object(std::string_view content, const std::string& path,
                           const std::function<void(int64_t line, const nlohmann::json& object)>& on_object) {
  int64_t line_number = 0;
  for_each_line(content, [&](size_t start, size_t end) {
    ++line_number;
    const auto line = content.substr(start, end - start);
    if (is_blank(line)) return;
    nlohmann::json value;
    try {
      value = nlohmann::json::parse(line.begin(), line.end());
    } catch (const nlohmann::json::exception& e) {  // syntax, and numbers out of range (406)
      fail("{}:{}: invalid JSON ({})", path, line_number, without_json_prefix(e.what()));
    }
    WEFT_CHECK(value.is_object(), "{}:{}: expected a JSON object, got {}", path, line_number,
               json_type_name(value));
    on_object(line_number, value);
  });
}

std::string jsonl_string_field(const nlohmann::json& object, const std::string& field, const std::string& path,
                               int64_t line) {
  const auto it = object.find(field);
  WEFT_CHECK(it != object.end(), "{}:{}: object has no field '{}'", path, line, field);
  WEFT_CHECK(it->is_string(), "{}:{}: field '{}' is {}, expected a string", path, line, field, json_type_name(*it));
  return it->get<std::string>();
}

std::vector<std::string> parse_jsonl_documents(std::string_view content, const std::string& path,
                                               const std::string& text_field) {
  std::vector<std::string> documents;
  for_each_jsonl_object(content, path, [&](int64_t line, const nlohmann::json& object) {
    auto text = jsonl_string_field(object, text_field, path, line);
    if (!text.empty()) documents.push_back(std::move(text));
  });
  return documents;
}

std::vector<uint32_t> decode_token_file(std::string_view bytes, DataFormat format,
                                        const std::string& path, int64_t vocab_size, const char* whose) {
  WEFT_CHECK(format == DataFormat::kTokensU16 || format == DataFormat::kTokensU32,
             "decode_token_file: '{}' is not a token format", data_format_name(format));
  const size_t width = format == DataFormat::kTokensU16 ? 2 : 4;
  WEFT_CHECK(bytes.size() % width == 0,
             "token file '{}': size {} bytes is not a multiple of {} ({})", path, bytes.size(),
             width, data_format_name(format));
  const size_t n = bytes.size() / width;
  std::vector<uint32_t> tokens(n);
  const auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char* p = data + i * width;
    uint32_t id = uint32_t(p[0]) | uint32_t(p[1]) << 8;
    if (width == 4) id |= uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
    tokens[i] = id;
  }
  for (size_t i = 0; i < n; ++i) {
    WEFT_CHECK(static_cast<int64_t>(tokens[i]) < vocab_size,
               "token file '{}': token {} at index {} (byte offset {}) is >= {} vocab_size {}", path, tokens[i], i,
               i * width, whose, vocab_size);
  }
  return tokens;
}

std::vector<uint64_t> token_document_offsets(const std::vector<uint32_t>& tokens,
                                             std::optional<int32_t> eos_id, int64_t chunk_tokens) {
  WEFT_CHECK(chunk_tokens > 0, "token_document_offsets: chunk_tokens must be positive");
  std::vector<uint64_t> offsets{0};
  const uint64_t n = tokens.size();
  const bool has_eos =
      eos_id && *eos_id >= 0 &&
      std::find(tokens.begin(), tokens.end(), static_cast<uint32_t>(*eos_id)) != tokens.end();
  if (has_eos) {
    for (uint64_t i = 0; i < n; ++i) {
      if (tokens[i] == static_cast<uint32_t>(*eos_id)) offsets.push_back(i + 1);
    }
    if (offsets.back() != n) offsets.push_back(n);
    return offsets;
  }
  for (uint64_t end = chunk_tokens; end < n; end += chunk_tokens) offsets.push_back(end);
  if (n > 0) offsets.push_back(n);
  return offsets;
}

std::string read_file_bytes(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  WEFT_CHECK(file != nullptr, "cannot open '{}' for reading", path);
  std::string bytes;
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (!ec) bytes.resize(size);
  const size_t read = std::fread(bytes.data(), 1, bytes.size(), file);
  const bool ok = read == bytes.size() && !std::ferror(file);
  std::fclose(file);
  WEFT_CHECK(ok, "cannot read '{}' ({} of {} bytes read)", path, read, bytes.size());
  return bytes;
}

}  // namespace weft
