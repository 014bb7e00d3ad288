#include "core/data/tokenizer.h"

#include <filesystem>

#include "core/data/bpe_tokenizer.h"
#include "core/data/byte_tokenizer.h"
#include "core/data/gguf_tokenizer.h"
#include "core/io/gguf.h"
#include "core/util/error.h"

namespace weft {

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec) {
  if (spec == "byte") return std::make_unique<ByteTokenizer>();
  if (is_gguf_path(spec)) return load_gguf_tokenizer(spec);  // the tokenizer in its metadata
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path path(spec);
  if (fs::is_directory(path, ec)) path /= "tokenizer.json";
  if (!fs::exists(path, ec)) fail("tokenizer {}: file not found (expected \"byte\", a tokenizer.json or a directory holding one)", path.string());
  if (!fs::is_regular_file(path, ec)) fail("tokenizer {}: not a regular file", path.string());
  return BpeTokenizer::from_file(path.string());
}

}  // namespace weft
