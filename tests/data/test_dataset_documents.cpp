// Reading dataset inputs: file resolution, text/JSONL document rules, token files.
#include <gtest/gtest.h>

#include "core/data/documents.h"
#include "core/util/error.h"
#include "test_dataset_util.h"

namespace weft {
namespace {

using dataset_test::expect_error;
using dataset_test::TempDir;
using dataset_test::token_bytes;
using Docs = std::vector<std::string>;

TEST(DatasetDocuments, ParagraphModeSplitsOnRunsOfBlankLines) {
  const std::string text = "\n\nfirst para\nsecond line\n\n \t\n\nnext\r\nmore\r\n\r\nlast";
  EXPECT_EQ(split_text_documents(text, TextDocumentMode::kParagraph),
            (Docs{"first para\nsecond line", "next\r\nmore", "last"}));
}

TEST(DatasetDocuments, LineModeKeepsNonBlankLinesWithoutTerminators) {
  EXPECT_EQ(split_text_documents("a b\n\n  \nc\r\nd", TextDocumentMode::kLine),
            (Docs{"a b", "c", "d"}));
}

TEST(DatasetDocuments, FileModeIsTheWholeTextVerbatimUnlessBlank) {
  EXPECT_EQ(split_text_documents("x\n\ny\n", TextDocumentMode::kFile), (Docs{"x\n\ny\n"}));
  EXPECT_TRUE(split_text_documents(" \n\t\n", TextDocumentMode::kFile).empty());
  EXPECT_TRUE(split_text_documents("", TextDocumentMode::kParagraph).empty());
}

TEST(DatasetDocuments, JsonlTakesTheTextFieldAndSkipsBlankLines) {
  const std::string content =
      "{\"text\": \"hello\", \"id\": 1}\n\n   \n{\"id\": 2, \"text\": \"w\\u00f6rld\\n2\"}\n"
      "{\"text\": \"\"}\r\n{\"body\": \"x\", \"text\": \"last\"}";
  EXPECT_EQ(parse_jsonl_documents(content, "d.jsonl", "text"),
            (Docs{"hello", "w\xc3\xb6rld\n2", "last"}));
  EXPECT_EQ(parse_jsonl_documents("{\"body\": \"b\"}\n", "d.jsonl", "body"), (Docs{"b"}));
}

TEST(DatasetDocuments, JsonlErrorsNameFileAndLine) {
  const std::string good = "{\"text\": \"ok\"}\n";
  expect_error([&] { parse_jsonl_documents(good + "\n{\"text\": \"unterminated}\n", "d.jsonl", "text"); },
               "d.jsonl:3: invalid JSON");
  // A number too large for a double (found by fuzz/jsonl.cpp: it escaped as nlohmann's out_of_range).
  expect_error([&] { parse_jsonl_documents(good + "{\"text\": \"a\", \"n\": 1e99999}\n", "d.jsonl", "text"); },
               "d.jsonl:2: invalid JSON");
  expect_error([&] { parse_jsonl_documents(good + "[1, 2]\n", "d.jsonl", "text"); },
               "d.jsonl:2: expected a JSON object, got array");
  expect_error([&] { parse_jsonl_documents(good + good + "{\"txt\": \"a\"}", "d.jsonl", "text"); },
               "d.jsonl:3: object has no field 'text'");
  expect_error([&] { parse_jsonl_documents("{\"text\": 5}", "d.jsonl", "text"); },
               "d.jsonl:1: field 'text' is number, expected a string");
}

TEST(DatasetDocuments, DecodesLittleEndianTokenFiles) {
  EXPECT_EQ(decode_token_file(std::string("\x01\x00\x02\x01", 4), DataFormat::kTokensU16, "t.u16",
                              1000),
            (std::vector<uint32_t>{1, 258}));
  EXPECT_EQ(decode_token_file(std::string("\x03\x00\x01\x00", 4), DataFormat::kTokensU32, "t.u32",
                              70000),
            (std::vector<uint32_t>{65539}));
  EXPECT_EQ(decode_token_file(token_bytes({7, 60000}, 2), DataFormat::kTokensU16, "t.u16", 65536),
            (std::vector<uint32_t>{7, 60000}));
}

TEST(DatasetDocuments, TokenFileErrorsNameFileAndOffset) {
  expect_error([] { decode_token_file("abc", DataFormat::kTokensU16, "t.u16", 1000); },
               "token file 't.u16': size 3 bytes is not a multiple of 2");
  expect_error([] { decode_token_file("abcdef", DataFormat::kTokensU32, "t.bin", 1000); },
               "token file 't.bin': size 6 bytes is not a multiple of 4");
  expect_error(
      [] { decode_token_file(token_bytes({1, 2, 300, 4}, 4), DataFormat::kTokensU32, "t.u32", 258); },
      "token file 't.u32': token 300 at index 2 (byte offset 8) is >= the tokenizer's vocab_size "
      "258");
}

TEST(DatasetDocuments, TokenStreamsSplitAfterEosOrIntoChunks) {
  const std::vector<uint32_t> with_eos{5, 6, 9, 7, 9, 9, 8};
  EXPECT_EQ(token_document_offsets(with_eos, 9), (std::vector<uint64_t>{0, 3, 5, 6, 7}));
  EXPECT_EQ(token_document_offsets({5, 9}, 9), (std::vector<uint64_t>{0, 2}));
  // eos id known but absent from the stream, or no eos id: fixed-size chunks.
  EXPECT_EQ(token_document_offsets(with_eos, 4, 3), (std::vector<uint64_t>{0, 3, 6, 7}));
  EXPECT_EQ(token_document_offsets({1, 2, 3, 4, 5, 6}, std::nullopt, 3),
            (std::vector<uint64_t>{0, 3, 6}));
  EXPECT_EQ(token_document_offsets({}, 9), (std::vector<uint64_t>{0}));
  std::vector<uint32_t> long_stream(kTokenFileChunk * 2 + 1, 1);
  EXPECT_EQ(token_document_offsets(long_stream, std::nullopt),
            (std::vector<uint64_t>{0, 8192, 16384, 16385}));
}

TEST(DatasetDocuments, DirectoriesExpandToKnownExtensionsSorted) {
  TempDir dir;
  dir.write("data/b.jsonl", "{}");
  dir.write("data/a.TXT", "x");
  dir.write("data/c.u16", "");
  dir.write("data/d.bin", "");
  dir.write("data/notes.csv", "x");
  dir.write("data/.hidden.txt", "x");
  dir.write("data/sub/e.txt", "x");
  const std::string d = dir.path("data");
  const auto files = resolve_inputs({d}, DataFormat::kAuto);
  ASSERT_EQ(files.size(), 4u);
  EXPECT_EQ(files[0].path, d + "/a.TXT");
  EXPECT_EQ(files[0].format, DataFormat::kText);
  EXPECT_EQ(files[1].path, d + "/b.jsonl");
  EXPECT_EQ(files[1].format, DataFormat::kJsonl);
  EXPECT_EQ(files[2].format, DataFormat::kTokensU16);
  EXPECT_EQ(files[3].path, d + "/d.bin");
  EXPECT_EQ(files[3].format, DataFormat::kTokensU32);

  // An explicit format picks only its own extensions; .bin belongs to both token formats.
  const auto u16 = resolve_inputs({d}, DataFormat::kTokensU16);
  ASSERT_EQ(u16.size(), 2u);
  EXPECT_EQ(u16[1].path, d + "/d.bin");
  EXPECT_EQ(u16[1].format, DataFormat::kTokensU16);
  expect_error([&] { resolve_inputs({dir.path("data/sub/")}, DataFormat::kJsonl); },
               "contains no jsonl files");
}

TEST(DatasetDocuments, FilesKeepOrderAndAutoDetectsByExtension) {
  TempDir dir;
  const auto md = dir.write("z.md", "x");
  const auto json = dir.write("a.json", "{}");
  const auto log = dir.write("b.log", "x");
  const auto files = resolve_inputs({md, json}, DataFormat::kAuto);
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0].path, md);
  EXPECT_EQ(files[0].format, DataFormat::kText);
  EXPECT_EQ(files[1].format, DataFormat::kJsonl);
  EXPECT_EQ(resolve_inputs({log}, DataFormat::kText)[0].format, DataFormat::kText);
  expect_error([&] { resolve_inputs({log}, DataFormat::kAuto); },
               "dataset file '" + log + "': cannot detect the format");
  expect_error([&] { resolve_inputs({dir.path("missing.txt")}, DataFormat::kAuto); },
               "dataset path '" + dir.path("missing.txt") + "' does not exist");
  expect_error([] { resolve_inputs({}, DataFormat::kAuto); }, "dataset has no input paths");
}

TEST(DatasetDocuments, ParsesFormatAndModeNames) {
  EXPECT_EQ(parse_data_format("tokens-u16"), DataFormat::kTokensU16);
  EXPECT_EQ(data_format_name(parse_data_format("jsonl")), "jsonl");
  EXPECT_EQ(parse_text_document_mode("line"), TextDocumentMode::kLine);
  expect_error([] { parse_data_format("csv"); }, "unknown dataset format 'csv'");
  expect_error([] { parse_text_document_mode("page"); }, "unknown text_document mode 'page'");
}

}  // namespace
}  // namespace weft
