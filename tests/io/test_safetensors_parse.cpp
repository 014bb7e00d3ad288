// Parsing hand-built files: reference bytes that other tools produce, every malformed-file
// rejection, index errors, and random corruption that must never get past validation.
#include <filesystem>
#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/io/safetensors.h"
#include "tests/io/io_test_util.h"

namespace weft {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::expect_identical;
using ::testing::HasSubstr;
using testing::safetensors_bytes;
using testing::write_bytes;

class SafetensorsParse : public testing::TempDirTest {
 protected:
  // Writes `bytes` to a file, opens it, and returns the weft::Error message, which must name it.
  std::string open_error(const std::string& bytes) {
    const std::string file = path("bad.safetensors");
    write_bytes(file, bytes);
    const std::string message = error_of([&] { SafetensorsFile::open(file); });
    EXPECT_THAT(message, HasSubstr(file));
    return message;
  }

  // open_error for a file with one tensor entry `entry` and `data_size` zero bytes of data.
  std::string entry_error(const std::string& entry, size_t data_size = 16) {
    return open_error(safetensors_bytes(R"({"t":)" + entry + "}", std::string(data_size, '\0')));
  }
};

// ---- Reference files, built byte by byte the way the HF safetensors library lays them out.

TEST_F(SafetensorsParse, ReadsHandWrittenReferenceFile) {
  // What safetensors.torch.save_file({"weight": torch.tensor([[1, 2], [3, 4]],
  // dtype=torch.float16)}) writes: compact JSON without metadata, padded with spaces so the data
  // starts at a multiple of 8.
  const std::string header = R"({"weight":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]}})";
  ASSERT_EQ(header.size(), 61u);
  const std::string bytes = std::string("\x40\0\0\0\0\0\0\0", 8) + header + "   " +
                            std::string("\x00\x3c\x00\x40\x00\x42\x00\x44", 8);
  write_bytes(path("ref.safetensors"), bytes);

  const auto file = SafetensorsFile::open(path("ref.safetensors"));
  EXPECT_TRUE(file->metadata().empty());
  ASSERT_EQ(file->tensors().size(), 1u);
  const TensorInfo& info = file->info("weight");
  EXPECT_EQ(info.dtype_name, "F16");
  EXPECT_EQ(info.shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(info.begin, 0u);
  EXPECT_EQ(info.end, 8u);
  expect_identical(file->load("weight", at::kFloat),
                   at::tensor({1.0f, 2.0f, 3.0f, 4.0f}).reshape({2, 2}));
  expect_identical(file->view("weight").to(at::kFloat),
                   at::tensor({1.0f, 2.0f, 3.0f, 4.0f}).reshape({2, 2}));
}

TEST_F(SafetensorsParse, ReadsMixedDtypesMetadataAndKeyOrder) {
  // Entries in any JSON order; storage order comes from the offsets.
  const std::string header = R"({"c":{"dtype":"I64","shape":[],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"BF16","shape":[1,2],"data_offsets":[16,20]},)"
                             R"("__metadata__":{"format":"pt","source":"hand"},)"
                             R"("a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},)"
                             R"("e":{"dtype":"BOOL","shape":[0],"data_offsets":[20,20]}})";
  const std::string data = std::string("\xfd\xff\xff\xff\xff\xff\xff\xff", 8)    // I64 -3
                           + std::string("\x00\x00\x80\x3f\x00\x00\x00\xc0", 8)  // F32 1, -2
                           + std::string("\x00\x3f\x40\x40", 4);                 // BF16 0.5, 3
  const std::string padded = header + std::string((8 - header.size() % 8) % 8, ' ');
  write_bytes(path("mixed.safetensors"), safetensors_bytes(padded, data));

  const auto file = SafetensorsFile::open(path("mixed.safetensors"));
  EXPECT_EQ(file->metadata(),
            (std::map<std::string, std::string>{{"format", "pt"}, {"source", "hand"}}));
  std::vector<std::string> order;
  for (const TensorInfo& info : file->tensors()) order.push_back(info.name);
  EXPECT_EQ(order, (std::vector<std::string>{"c", "a", "b", "e"}));
  expect_identical(file->load("c"), at::scalar_tensor(-3, at::kLong));
  expect_identical(file->view("a"), at::tensor({1.0f, -2.0f}));
  expect_identical(file->load("b", at::kFloat), at::tensor({0.5f, 3.0f}).reshape({1, 2}));
  expect_identical(file->load("e"), at::empty({0}, at::kBool));
}

TEST_F(SafetensorsParse, AcceptsEmptyFileWithNoTensors) {
  write_bytes(path("none.safetensors"), safetensors_bytes("{}      "));
  const auto file = SafetensorsFile::open(path("none.safetensors"));
  EXPECT_TRUE(file->tensors().empty());
  EXPECT_TRUE(file->metadata().empty());
}

TEST_F(SafetensorsParse, EmptyTensorsMayShareAnOffset) {
  const std::string header = R"({"x":{"dtype":"F32","shape":[0],"data_offsets":[3,3]},)"
                             R"("y":{"dtype":"I8","shape":[0,5],"data_offsets":[4,4]},)"
                             R"("z":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  write_bytes(path("e.safetensors"), safetensors_bytes(header, std::string(8, '\0')));
  const auto file = SafetensorsFile::open(path("e.safetensors"));
  EXPECT_EQ(file->tensors().size(), 3u);
  EXPECT_EQ(file->view("x").numel(), 0);  // no bytes, so no alignment to respect
  EXPECT_EQ(file->load("y").sizes(), at::IntArrayRef({0, 5}));
}

// ---- Malformed files: one distinct message per problem.

TEST_F(SafetensorsParse, RejectsFileShorterThanLengthPrefix) {
  EXPECT_THAT(open_error(""), HasSubstr("file is 0 bytes, shorter than the 8-byte header length"));
  EXPECT_THAT(open_error(std::string("\x05\0\0\0\0", 5)),
              HasSubstr("file is 5 bytes, shorter than the 8-byte"));
}

TEST_F(SafetensorsParse, RejectsHeaderLengthPastEndOfFile) {
  EXPECT_THAT(open_error(testing::u64_le(100) + "{}"),
              HasSubstr("header length 100 runs past the end of the file (10 bytes)"));
  EXPECT_THAT(open_error(testing::u64_le(~0ull) + "{}"), HasSubstr("is absurdly large"));
  EXPECT_THAT(open_error(testing::u64_le(200'000'000) + "{}"),
              HasSubstr("header length 200000000 is absurdly large"));
}

TEST_F(SafetensorsParse, RejectsInvalidJsonAndNonObjects) {
  EXPECT_THAT(open_error(safetensors_bytes("{\"t\": ")), HasSubstr("header is not valid JSON"));
  EXPECT_THAT(open_error(safetensors_bytes("not json")), HasSubstr("header is not valid JSON"));
  EXPECT_THAT(open_error(safetensors_bytes("{} {}")), HasSubstr("header is not valid JSON"));
  EXPECT_THAT(open_error(safetensors_bytes(std::string("{}\0{\"t\":1}", 10))),
              HasSubstr("header is not valid JSON: it contains a NUL byte"));
  EXPECT_THAT(open_error(safetensors_bytes("\"\xff\"")), HasSubstr("header is not valid JSON"));
  EXPECT_THAT(open_error(safetensors_bytes(std::string(100000, '[') + std::string(100000, ']'))),
              HasSubstr("header JSON is not an object"));
  EXPECT_THAT(open_error(safetensors_bytes("[1, 2]")), HasSubstr("header JSON is not an object"));
  EXPECT_THAT(open_error(safetensors_bytes("")), HasSubstr("header is not valid JSON"));
}

TEST_F(SafetensorsParse, RejectsEntriesMissingFields) {
  EXPECT_THAT(entry_error(R"({"shape":[2],"data_offsets":[0,8]})"),
              HasSubstr("tensor 't' is missing \"dtype\""));
  EXPECT_THAT(entry_error(R"({"dtype":"F32","data_offsets":[0,8]})"),
              HasSubstr("tensor 't' is missing \"shape\""));
  EXPECT_THAT(entry_error(R"({"dtype":"F32","shape":[2]})"),
              HasSubstr("tensor 't' is missing \"data_offsets\""));
}

TEST_F(SafetensorsParse, RejectsFieldsOfWrongType) {
  EXPECT_THAT(entry_error(R"([1, 2])"), HasSubstr("tensor 't': entry is not an object"));
  EXPECT_THAT(entry_error(R"({"dtype":32,"shape":[2],"data_offsets":[0,8]})"),
              HasSubstr("tensor 't': \"dtype\" is not a string"));
  EXPECT_THAT(entry_error(R"({"dtype":"F32","shape":2,"data_offsets":[0,8]})"),
              HasSubstr("tensor 't': \"shape\" is not an array"));
  EXPECT_THAT(entry_error(R"({"dtype":"F32","shape":[2.0],"data_offsets":[0,8]})"),
              HasSubstr("tensor 't': \"shape\" holds a non-integer 2.0"));
  EXPECT_THAT(entry_error(R"({"dtype":"F32","shape":["2"],"data_offsets":[0,8]})"),
              HasSubstr("\"shape\" holds a non-integer \"2\""));
  for (const char* offsets : {"[0]", "[0,8,8]", "\"0,8\"", "[0,8.0]", "[-8,8]", "[0,null]"}) {
    EXPECT_THAT(
        entry_error(std::string(R"({"dtype":"F32","shape":[2],"data_offsets":)") + offsets + "}"),
        HasSubstr("tensor 't': \"data_offsets\" is not [begin, end] of non-negative "
                  "integers"))
        << offsets;
  }
  EXPECT_THAT(open_error(safetensors_bytes(R"({"__metadata__":{"k":1}})")),
              HasSubstr("__metadata__ value for 'k' is not a string"));
  EXPECT_THAT(open_error(safetensors_bytes(R"({"__metadata__":["k"]})")),
              HasSubstr("__metadata__ is not an object"));
}

TEST_F(SafetensorsParse, RejectsUnsupportedDtypes) {
  for (const std::string dtype : {"F8_E4M3", "U16", "F4", "f32", "", "garbage"}) {
    EXPECT_THAT(entry_error(R"({"dtype":")" + dtype + R"(","shape":[2],"data_offsets":[0,2]})"),
                HasSubstr("tensor 't' has unsupported dtype '" + dtype + "'"));
  }
}

TEST_F(SafetensorsParse, RejectsNegativeAndHugeDimensions) {
  EXPECT_THAT(entry_error(R"({"dtype":"F32","shape":[2,-2],"data_offsets":[0,16]})"),
              HasSubstr("tensor 't' has negative dimension -2"));
  EXPECT_THAT(entry_error(R"({"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,4]})"),
              HasSubstr("dimension 18446744073709551615 is too large"));
  EXPECT_THAT(
      entry_error(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]})"),
      HasSubstr("shape [4294967296, 4294967296] of F32 overflows a 64-bit byte count"));
}

TEST_F(SafetensorsParse, RejectsBadOffsets) {
  EXPECT_THAT(entry_error(R"({"dtype":"F32","shape":[1],"data_offsets":[8,4]})"),
              HasSubstr("tensor 't': data_offsets begin 8 is greater than end 4"));
  EXPECT_THAT(entry_error(R"({"dtype":"F32","shape":[1],"data_offsets":[16,20]})", 16),
              HasSubstr("tensor 't': data_offsets end 20 is past the end of the data region "
                        "(16 bytes)"));
  EXPECT_THAT(entry_error(R"({"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551615]})"),
              HasSubstr("is past the end of the data region"));
}

TEST_F(SafetensorsParse, RejectsByteCountMismatch) {
  EXPECT_THAT(
      entry_error(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})"),
      HasSubstr("tensor 't': data_offsets span 8 bytes but shape [3] of F32 needs 12 bytes"));
  EXPECT_THAT(entry_error(R"({"dtype":"BF16","shape":[],"data_offsets":[0,0]})"),
              HasSubstr("data_offsets span 0 bytes but shape [] of BF16 needs 2 bytes"));
}

TEST_F(SafetensorsParse, RejectsOverlappingTensors) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                             R"("b":{"dtype":"F32","shape":[1],"data_offsets":[20,24]},)"
                             R"("c":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
  EXPECT_THAT(open_error(safetensors_bytes(header, std::string(24, '\0'))),
              HasSubstr("tensors 'a' [0, 16) and 'c' [8, 16) overlap"));
  const std::string same = R"({"a":{"dtype":"I8","shape":[4],"data_offsets":[0,4]},)"
                           R"("b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})";
  EXPECT_THAT(open_error(safetensors_bytes(same, std::string(4, '\0'))),
              HasSubstr("tensors 'a' [0, 4) and 'b' [0, 4) overlap"));
}

TEST_F(SafetensorsParse, RejectsBytesOutsideEveryTensor) {
  // The tensors must tile the data region exactly (huggingface/safetensors refuses anything else):
  // bytes after the last tensor, and bytes between two tensors, are rejected.
  const std::string one = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  EXPECT_THAT(open_error(safetensors_bytes(one, std::string(9, '\0'))),
              HasSubstr("1 bytes after the last tensor's data (the data region ends at byte 8 of 9)"));
  EXPECT_THAT(open_error(safetensors_bytes(one, std::string(8, '\0') + "trailing garbage")),
              HasSubstr("16 bytes after the last tensor's data"));
  const std::string gap = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                          R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})";
  EXPECT_THAT(open_error(safetensors_bytes(gap, std::string(12, '\0'))),
              HasSubstr("bytes [4, 8) of the data region belong to no tensor (before 'b')"));
  const std::string late = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  EXPECT_THAT(open_error(safetensors_bytes(late, std::string(8, '\0'))),
              HasSubstr("bytes [0, 4) of the data region belong to no tensor (before 'a')"));
  // An empty file of tensors is a zero-byte data region; empty tensors sit anywhere on the tiling.
  const std::string empties = R"({"e":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
                              R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                              R"("z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})";
  write_bytes(path("empties.safetensors"), safetensors_bytes(empties, std::string(4, '\0')));
  EXPECT_EQ(SafetensorsFile::open(path("empties.safetensors"))->tensors().size(), 3u);
}

TEST_F(SafetensorsParse, RejectsDuplicateNamesInHeader) {
  const std::string header = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                             R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})";
  EXPECT_THAT(open_error(safetensors_bytes(header, "xy")),
              HasSubstr("duplicate tensor name 'a' in header"));
}

TEST_F(SafetensorsParse, RejectsNonFilesClearly) {
  EXPECT_THAT(error_of([&] { SafetensorsFile::open(path("absent.safetensors")); }),
              HasSubstr(path("absent.safetensors") + ": cannot open: No such file"));
  EXPECT_THAT(error_of([&] { SafetensorsFile::open(dir_.string()); }),
              HasSubstr("not a regular file"));
}

// Random corruption of a valid file: every outcome is either a clean weft::Error or a file
// whose tensors all load within bounds.
TEST_F(SafetensorsParse, SurvivesRandomCorruption) {
  save_safetensors(path("good.safetensors"), {{"w", at::arange(6, at::kFloat).reshape({2, 3})},
                                              {"b", at::ones({3}, at::kBFloat16)},
                                              {"s", at::scalar_tensor(7, at::kLong)}});
  const std::string good = testing::read_bytes(path("good.safetensors"));
  const size_t header_end = 8 + (uint8_t(good[0]) | (uint8_t(good[1]) << 8));
  std::mt19937 random(1234);
  int accepted = 0, rejected = 0;
  for (int round = 0; round < 1500; ++round) {
    std::string bytes = good;
    switch (round % 3) {
      case 0:  // truncate anywhere
        bytes.resize(random() % good.size());
        break;
      case 1:  // replace a header byte with anything
        bytes[random() % header_end] = char(random());
        break;
      case 2: {  // replace a digit in the JSON with another digit
        size_t at = 8 + random() % (header_end - 8);
        while (at < header_end && !std::isdigit(uint8_t(bytes[at]))) ++at;
        if (at < header_end) bytes[at] = char('0' + random() % 10);
        break;
      }
    }
    // A fresh name each round: rewriting one file in place makes ext4 flush it every time.
    const std::string fuzz_path = path("fuzz" + std::to_string(round) + ".safetensors");
    write_bytes(fuzz_path, bytes);
    std::shared_ptr<SafetensorsFile> file;
    try {
      file = SafetensorsFile::open(fuzz_path);
      fs::remove(fuzz_path);
    } catch (const weft::Error&) {
      fs::remove(fuzz_path);
      ++rejected;
      continue;
    }
    ++accepted;
    for (const TensorInfo& info : file->tensors()) {
      EXPECT_EQ(uint64_t(file->load(info.name).numel()) * c10::elementSize(info.dtype),
                info.nbytes());
      if (!info.shape.empty() && info.shape[0] > 0) file->load_slice(info.name, 0, 0, 1);
    }
  }
  EXPECT_GT(accepted, 0);
  EXPECT_GT(rejected, 0);
}

// ---- Index files.

class SafetensorsIndex : public SafetensorsParse {
 protected:
  void SetUp() override {
    SafetensorsParse::SetUp();
    save_safetensors(path("s1.safetensors"), {{"a", at::ones({2})}, {"b", at::zeros({2})}});
    save_safetensors(path("s2.safetensors"), {{"c", at::full({2}, 3.0f)}});
  }

  std::string index_error(const std::string& json) {
    const std::string index = path("model.safetensors.index.json");
    write_bytes(index, json);
    const std::string message = error_of([&] { SafetensorsCheckpoint::open(index); });
    EXPECT_THAT(message, HasSubstr(index));
    return message;
  }
};

TEST_F(SafetensorsIndex, OpensHandWrittenIndex) {
  write_bytes(path("model.safetensors.index.json"),
              R"({"metadata": {"total_size": 24},
                  "weight_map": {"c": "s2.safetensors", "a": "s1.safetensors",
                                 "b": "s1.safetensors"}})");
  for (const std::string& where : {dir_.string(), path("model.safetensors.index.json")}) {
    const auto checkpoint = SafetensorsCheckpoint::open(where);
    EXPECT_EQ(checkpoint.names(), (std::vector<std::string>{"a", "b", "c"}));
    expect_identical(checkpoint.load("c"), at::full({2}, 3.0f));
    EXPECT_EQ(checkpoint.info("b").dtype_name, "F32");
  }
}

TEST_F(SafetensorsIndex, ListsOnlyMappedTensors) {
  write_bytes(path("model.safetensors.index.json"), R"({"weight_map": {"a": "s1.safetensors"}})");
  const auto checkpoint = SafetensorsCheckpoint::open(dir_.string());
  EXPECT_EQ(checkpoint.names(), std::vector<std::string>{"a"});
  EXPECT_FALSE(checkpoint.contains("b"));
}

TEST_F(SafetensorsIndex, RejectsMissingShardFile) {
  EXPECT_THAT(index_error(R"({"weight_map": {"a": "s1.safetensors", "z": "s9.safetensors"}})"),
              HasSubstr("weight_map file '" + path("s9.safetensors") + "' does not exist"));
}

TEST_F(SafetensorsIndex, RejectsDuplicateNames) {
  EXPECT_THAT(index_error(R"({"weight_map": {"a": "s1.safetensors", "a": "s2.safetensors"}})"),
              HasSubstr("duplicate tensor name 'a' in weight_map"));
}

TEST_F(SafetensorsIndex, RejectsTensorStoredInTwoShards) {
  save_safetensors(path("s3.safetensors"), {{"a", at::ones({1})}});
  EXPECT_THAT(index_error(R"({"weight_map": {"a": "s1.safetensors", "c": "s3.safetensors"}})"),
              HasSubstr("tensor 'a' is stored in both " + path("s1.safetensors") + " and " +
                        path("s3.safetensors")));
}

TEST_F(SafetensorsIndex, RejectsTensorAbsentFromItsShard) {
  EXPECT_THAT(index_error(R"({"weight_map": {"c": "s1.safetensors", "a": "s1.safetensors"}})"),
              HasSubstr("weight_map maps tensor 'c' to " + path("s1.safetensors") +
                        ", which has no such tensor"));
}

TEST_F(SafetensorsIndex, RejectsPathsOutsideTheDirectory) {
  for (const std::string file : {"../s1.safetensors", "/etc/passwd", "sub/s1.safetensors", ""}) {
    EXPECT_THAT(
        index_error(R"({"weight_map": {"a": ")" + file + R"("}})"),
        HasSubstr("weight_map file '" + file + "' for tensor 'a' is not a plain file name"));
  }
}

TEST_F(SafetensorsIndex, RejectsMalformedIndex) {
  EXPECT_THAT(index_error("{"), HasSubstr("index is not valid JSON"));
  EXPECT_THAT(index_error(std::string(R"({"weight_map": {}})"
                                      "\0garbage",
                                      26)),
              HasSubstr("index is not valid JSON: it contains a NUL byte"));
  EXPECT_THAT(index_error("[]"), HasSubstr("index JSON is not an object"));
  EXPECT_THAT(index_error(R"({"metadata": {}})"), HasSubstr("index has no \"weight_map\""));
  EXPECT_THAT(index_error(R"({"weight_map": []})"), HasSubstr("\"weight_map\" is not an object"));
  EXPECT_THAT(index_error(R"({"weight_map": {"a": 1}})"),
              HasSubstr("weight_map entry for tensor 'a' is not a string"));
}

TEST_F(SafetensorsIndex, ReportsMalformedShardByItsOwnPath) {
  write_bytes(path("s2.safetensors"), "short");
  write_bytes(path("model.safetensors.index.json"), R"({"weight_map": {"c": "s2.safetensors"}})");
  EXPECT_THAT(error_of([&] { SafetensorsCheckpoint::open(path("model.safetensors.index.json")); }),
              HasSubstr(path("s2.safetensors") + ": file is 5 bytes"));
}

TEST_F(SafetensorsIndex, RejectsDirectoryWithoutWeights) {
  fs::create_directories(path("empty"));
  EXPECT_THAT(error_of([&] { SafetensorsCheckpoint::open(path("empty")); }),
              HasSubstr(path("empty") + ": directory holds neither model.safetensors nor "
                                        "model.safetensors.index.json"));
  EXPECT_THAT(error_of([&] { SafetensorsCheckpoint::open(path("nothing.safetensors")); }),
              HasSubstr("cannot open"));
}

}  // namespace
}  // namespace weft
