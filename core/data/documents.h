// Reading dataset inputs into documents, before tokenization.
//
// A dataset is a list of paths (files or directories). Every file has one concrete format:
//  - text        .txt/.text/.md   documents per TextDocumentMode (see split_text_documents)
//  - jsonl       .jsonl/.json     one JSON object per line, the document is its text field
//  - tokens-u16  .u16             raw little-endian uint16 token ids (already tokenized)
//  - tokens-u32  .u32/.bin        raw little-endian uint32 token ids (already tokenized)
// "auto" picks the format of each file from its extension. Documents never are empty: blank
// paragraphs/lines/files and empty JSONL texts produce no document.
#pragma once

#include <functional>

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace weft {

enum class DataFormat { kAuto, kText, kJsonl, kTokensU16, kTokensU32 };
enum class TextDocumentMode { kFile, kParagraph, kLine };

// Parses "auto", "text", "jsonl", "tokens-u16", "tokens-u32". Throws weft::Error otherwise.
DataFormat parse_data_format(const std::string& name);
std::string data_format_name(DataFormat format);

// Parses "file", "paragraph", "line". Throws weft::Error otherwise.
TextDocumentMode parse_text_document_mode(const std::string& name);
std::string text_document_mode_name(TextDocumentMode mode);

// The format implied by a path's extension (case-insensitive), or nullopt when unknown.
std::optional<DataFormat> format_from_extension(const std::string& path);

struct InputFile {
  std::string path;   // as given, or directory + file name for expanded directories
  DataFormat format;  // never kAuto
};

// Expands `paths` in order into files with a concrete format.
//  - A file keeps its path; its format is `format`, or with kAuto the one its extension implies
//    (unknown extension -> weft::Error naming the file and the known extensions).
//  - A directory expands (not recursively) to its regular, non-hidden files whose extension
//    belongs to `format` (any known extension for kAuto), sorted by name; a directory with no
//    such file -> weft::Error. (tokens-u16 claims .u16 and .bin, tokens-u32 .u32 and .bin.)
//  - A missing path -> weft::Error naming it. An empty `paths` -> weft::Error.
std::vector<InputFile> resolve_inputs(const std::vector<std::string>& paths, DataFormat format);

// Cuts a text file into documents. A line is "blank" when it holds only whitespace; line
// terminators are "\n" or "\r\n".
//  - kFile: the whole text is one document, verbatim (none if the text is blank).
//  - kParagraph: documents are runs of non-blank lines separated by one or more blank lines;
//    a document is the text from its first line's start to its last line's end (inner line
//    breaks kept verbatim, the final terminator excluded).
//  - kLine: each non-blank line is a document, without its terminator.
std::vector<std::string> split_text_documents(std::string_view text, TextDocumentMode mode);

// Walks JSONL content: calls on_object(line, object) for every non-blank line (numbered from 1,
// "\r\n" endings allowed), which must hold one JSON object; otherwise weft::Error "path:line:
// invalid JSON (...)" or "path:line: expected a JSON object, got ...". The JSONL readers (documents
// here, labeled examples in labeled.h) share it.
void for_each_jsonl_object(std::string_view content, const std::string& path,
                           const std::function<void(int64_t line, const nlohmann::json& object)>& on_object);
// The string field `field` of a JSONL object; weft::Error "path:line: object has no field 'x'" or
// "path:line: field 'x' is <type>, expected a string".
std::string jsonl_string_field(const nlohmann::json& object, const std::string& field, const std::string& path,
                               int64_t line);

// Parses JSONL content: one JSON object per line, the document is the string `text_field`.
// Blank lines and empty texts produce no document. A line that is not valid JSON, not an
// object, lacks `text_field` or whose field is not a string -> weft::Error "path:line: problem".
std::vector<std::string> parse_jsonl_documents(std::string_view content, const std::string& path,
                                               const std::string& text_field);

// Decodes raw little-endian token ids (element size 2 for kTokensU16, 4 for kTokensU32) and
// checks each id against vocab_size (`whose`: "the tokenizer's" or "the model's", for the message).
// Throws weft::Error naming `path` when the size is not a multiple of the element size, or naming
// the token index and byte offset of an id >= vocab_size.
std::vector<uint32_t> decode_token_file(std::string_view bytes, DataFormat format,
                                        const std::string& path, int64_t vocab_size,
                                        const char* whose = "the tokenizer's");

// Document boundaries of a pre-tokenized stream, as offsets (first 0, last tokens.size()).
// With an eos id that occurs in the stream, each document ends right after an eos token (a
// trailing run without eos is the last document). Otherwise the stream is cut every
// `chunk_tokens` tokens (the last document may be shorter). An empty stream has no documents.
inline constexpr int64_t kTokenFileChunk = 8192;
std::vector<uint64_t> token_document_offsets(const std::vector<uint32_t>& tokens,
                                             std::optional<int32_t> eos_id,
                                             int64_t chunk_tokens = kTokenFileChunk);

// Reads a whole file into memory. Throws weft::Error naming the file when it cannot be read.
std::string read_file_bytes(const std::string& path);

}  // namespace weft
