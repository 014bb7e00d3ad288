// Round trips through save_safetensors / SafetensorsFile, views, slices, dtype conversion, sharded
// checkpoints and atomic writes.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/io/safetensors.h"
#include "tests/io/io_test_util.h"

namespace weft {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::expect_identical;
using ::testing::HasSubstr;
using testing::read_bytes;

class SafetensorsRoundTrip : public testing::TempDirTest {};

at::Tensor floats(std::vector<double> values, at::ScalarType dtype) {
  return at::tensor(values, at::kDouble).to(dtype);
}

// One tensor per supported dtype (with extreme and special values), plus 0-dim and empty ones.
NamedTensors every_dtype() {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  return {
      {"f64", floats({1.5, -2.25, 1e300, 5e-324, -0.0, nan}, at::kDouble).reshape({2, 3})},
      {"f32", floats({0.1, -3.0e38, 1e-45, inf, -inf, nan}, at::kFloat).reshape({3, 2})},
      {"f16", floats({65504.0, -0.5, 6e-8, 1.0 / 3}, at::kHalf)},
      {"bf16", floats({3.0e38, -1.0, 0.15625, 1e-39}, at::kBFloat16).reshape({2, 1, 2})},
      {"i64", at::tensor(std::vector<int64_t>{INT64_MIN, INT64_MAX, -1, 0}, at::kLong)},
      {"i32", at::tensor(std::vector<int32_t>{INT32_MIN, INT32_MAX, 7}, at::kInt)},
      {"i16", at::tensor(std::vector<int16_t>{-32768, 32767}, at::kShort)},
      {"i8", at::tensor(std::vector<int8_t>{-128, 127, 0}, at::kChar)},
      {"u8", at::tensor(std::vector<uint8_t>{0, 255, 17}, at::kByte)},
      {"bool", at::tensor(std::vector<uint8_t>{1, 0, 0, 1}, at::kByte).to(at::kBool)},
      {"scalar", at::scalar_tensor(-7.25, at::kFloat)},
      {"empty", at::empty({0, 3}, at::kFloat)},
      {"empty_inner", at::empty({2, 0, 4}, at::kBFloat16)},
  };
}

TEST_F(SafetensorsRoundTrip, EveryDtypeKeepsValuesShapesAndNames) {
  const NamedTensors tensors = every_dtype();
  save_safetensors(path("all.safetensors"), tensors);
  const auto file = SafetensorsFile::open(path("all.safetensors"));

  ASSERT_EQ(file->tensors().size(), tensors.size());
  const std::map<std::string, std::string> expected_names = {
      {"f64", "F64"},         {"f32", "F32"},   {"f16", "F16"},    {"bf16", "BF16"},
      {"i64", "I64"},         {"i32", "I32"},   {"i16", "I16"},    {"i8", "I8"},
      {"u8", "U8"},           {"bool", "BOOL"}, {"scalar", "F32"}, {"empty", "F32"},
      {"empty_inner", "BF16"}};
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, tensor] = tensors[i];
    SCOPED_TRACE(name);
    EXPECT_EQ(file->tensors()[i].name, name);  // storage order is the order given
    const TensorInfo& info = file->info(name);
    EXPECT_EQ(info.dtype_name, expected_names.at(name));
    EXPECT_EQ(info.dtype, tensor.scalar_type());
    EXPECT_EQ(info.shape, tensor.sizes().vec());
    EXPECT_EQ(info.nbytes(), uint64_t(tensor.numel() * tensor.element_size()));
    expect_identical(file->load(name), tensor);
  }
  EXPECT_EQ(file->info("scalar").shape.size(), 0u);
  EXPECT_EQ(file->load("scalar").dim(), 0);
  EXPECT_EQ(file->load("scalar").item<float>(), -7.25f);
}

TEST_F(SafetensorsRoundTrip, WriterProducesTheReferenceLayout) {
  save_safetensors(path("x.safetensors"), {{"x", at::tensor({1.0f, 2.0f})}});
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  ASSERT_EQ(header.size(), 85u);
  const std::string padded = header + std::string(3, ' ');  // to a multiple of 8
  const std::string data("\x00\x00\x80\x3f\x00\x00\x00\x40", 8);
  EXPECT_EQ(read_bytes(path("x.safetensors")), testing::safetensors_bytes(padded, data));
}

TEST_F(SafetensorsRoundTrip, MetadataRoundTrips) {
  const at::Tensor t = at::ones({1});
  save_safetensors(path("plain.safetensors"), {{"t", t}});
  EXPECT_EQ(SafetensorsFile::open(path("plain.safetensors"))->metadata(),
            (std::map<std::string, std::string>{{"format", "pt"}}));

  const std::map<std::string, std::string> extra = {{"step", "42"}, {"note", "héllo \"q\"\n"}};
  save_safetensors(path("extra.safetensors"), {{"t", t}}, extra);
  auto with_format = extra;
  with_format["format"] = "pt";
  EXPECT_EQ(SafetensorsFile::open(path("extra.safetensors"))->metadata(), with_format);

  const std::map<std::string, std::string> own_format = {{"format", "mlx"}, {"k", ""}};
  save_safetensors(path("own.safetensors"), {{"t", t}}, own_format);
  EXPECT_EQ(SafetensorsFile::open(path("own.safetensors"))->metadata(), own_format);
}

TEST_F(SafetensorsRoundTrip, LoadConvertsDtype) {
  // Every value is exactly representable in bf16, so bf16 -> f32 must be exact.
  const std::vector<double> values = {
      1.0, -2.5, 0.15625, 1.0 / 1024, -65536.0, 0.0, std::ldexp(1.0, 100)};
  const at::Tensor bf16 = floats(values, at::kBFloat16);
  save_safetensors(path("c.safetensors"), {{"w", bf16}, {"i", at::tensor({-3, 9}, at::kInt)}});
  const auto file = SafetensorsFile::open(path("c.safetensors"));

  const at::Tensor as_f32 = file->load("w", at::kFloat);
  EXPECT_EQ(as_f32.scalar_type(), at::kFloat);
  expect_identical(as_f32, floats(values, at::kFloat));
  expect_identical(file->load("w", at::kBFloat16), bf16);
  expect_identical(file->load("i", at::kDouble), at::tensor({-3.0, 9.0}, at::kDouble));
}

TEST_F(SafetensorsRoundTrip, LoadSliceEqualsNarrowOfLoad) {
  const at::Tensor f32 = at::arange(4 * 6 * 5, at::kFloat).reshape({4, 6, 5});
  const at::Tensor bf16 = at::arange(3 * 8, at::kFloat).reshape({3, 8}).to(at::kBFloat16);
  save_safetensors(path("s.safetensors"), {{"f32", f32}, {"bf16", bf16}});
  const auto file = SafetensorsFile::open(path("s.safetensors"));

  struct Slice {
    int64_t dim, start, length;
  };
  for (const Slice& s : std::vector<Slice>{
           {0, 1, 2}, {1, 2, 3}, {2, 0, 5}, {-1, 4, 1}, {1, 6, 0}, {0, 0, 4}, {-3, 3, 1}}) {
    SCOPED_TRACE(::testing::Message() << "dim " << s.dim << " start " << s.start);
    expect_identical(file->load_slice("f32", s.dim, s.start, s.length),
                     file->load("f32").narrow(s.dim, s.start, s.length));
  }
  expect_identical(file->load_slice("bf16", 1, 4, 4), bf16.narrow(1, 4, 4));
  expect_identical(file->load_slice("bf16", 0, 1, 2, at::kFloat),
                   bf16.narrow(0, 1, 2).to(at::kFloat));
}

TEST_F(SafetensorsRoundTrip, LoadSliceRejectsBadRanges) {
  save_safetensors(path("s.safetensors"),
                   {{"m", at::zeros({4, 6})}, {"scalar", at::scalar_tensor(1.0)}});
  const auto file = SafetensorsFile::open(path("s.safetensors"));
  EXPECT_THAT(error_of([&] { file->load_slice("m", 2, 0, 1); }),
              HasSubstr("slice dim 2 is out of range for 2 dims"));
  EXPECT_THAT(error_of([&] { file->load_slice("m", -3, 0, 1); }), HasSubstr("out of range"));
  EXPECT_THAT(error_of([&] { file->load_slice("m", 1, 4, 3); }),
              HasSubstr("slice [4, 4+3) is outside dim 1 of size 6"));
  EXPECT_THAT(error_of([&] { file->load_slice("m", 0, -1, 1); }), HasSubstr("is outside"));
  EXPECT_THAT(error_of([&] { file->load_slice("m", 0, 0, -1); }), HasSubstr("is outside"));
  EXPECT_THAT(error_of([&] { file->load_slice("m", 0, 1, INT64_MAX); }), HasSubstr("is outside"));
  EXPECT_THAT(error_of([&] { file->load_slice("scalar", 0, 0, 1); }),
              HasSubstr("'scalar' is 0-dim and cannot be sliced"));
}

// The mapping of `file` in /proc/self/maps that holds `address`, or "" when none does.
std::string mapping_holding(const void* address) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const auto target = reinterpret_cast<uintptr_t>(address);
  while (std::getline(maps, line)) {
    uintptr_t begin = 0, end = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &begin, &end) != 2) continue;
    if (target >= begin && target < end) return line;
  }
  return "";
}

TEST_F(SafetensorsRoundTrip, ViewIsZeroCopyAndOutlivesTheFile) {
  const at::Tensor weights = at::arange(64, at::kFloat).reshape({8, 8});
  save_safetensors(path("v.safetensors"), {{"bias", at::ones({3}, at::kDouble)}, {"w", weights}});
  const std::string canonical = fs::canonical(path("v.safetensors")).string();

  auto file = SafetensorsFile::open(path("v.safetensors"));
  at::Tensor view = file->view("w");
  const at::Tensor bias = file->view("bias");
  EXPECT_EQ(static_cast<uint8_t*>(view.data_ptr()) - static_cast<uint8_t*>(bias.data_ptr()),
            int64_t(file->info("w").begin - file->info("bias").begin));
  EXPECT_THAT(mapping_holding(view.data_ptr()), HasSubstr(canonical));
  file.reset();  // the view keeps the mapping alive

  expect_identical(view, weights);
  EXPECT_THAT(mapping_holding(view.data_ptr()), HasSubstr(canonical));

  view.mul_(2);  // private copy-on-write: the file is untouched
  expect_identical(view, weights * 2);
  expect_identical(SafetensorsFile::open(path("v.safetensors"))->load("w"), weights);

  const void* address = view.data_ptr();
  view = at::Tensor();
  EXPECT_THAT(mapping_holding(address), HasSubstr(canonical));  // `bias` still holds it
}

TEST_F(SafetensorsRoundTrip, MappingIsReleasedWithTheLastView) {
  save_safetensors(path("v.safetensors"), {{"w", at::ones({4})}});
  at::Tensor view = SafetensorsFile::open(path("v.safetensors"))->view("w");
  const void* address = view.data_ptr();
  const std::string canonical = fs::canonical(path("v.safetensors")).string();
  EXPECT_THAT(mapping_holding(address), HasSubstr(canonical));
  view = at::Tensor();
  EXPECT_THAT(mapping_holding(address), ::testing::Not(HasSubstr(canonical)));
}

TEST_F(SafetensorsRoundTrip, UnalignedViewIsRefusedButLoads) {
  // Written in the order given: 3 bytes of U8 push the F32 tensor to data offset 3.
  const at::Tensor w = at::tensor({1.5f, -2.0f});
  save_safetensors(path("u.safetensors"), {{"tag", at::ones({3}, at::kByte)}, {"w", w}});
  const auto file = SafetensorsFile::open(path("u.safetensors"));
  EXPECT_EQ(file->info("w").begin, 3u);
  EXPECT_THAT(error_of([&] { file->view("w"); }),
              HasSubstr("'w' is not aligned to its 4-byte elements"));
  expect_identical(file->load("w"), w);
  expect_identical(file->load_slice("w", 0, 1, 1), w.narrow(0, 1, 1));
  expect_identical(file->view("tag"), at::ones({3}, at::kByte));
}

TEST_F(SafetensorsRoundTrip, NonContiguousAndGradTensorsAreWrittenContiguous) {
  const at::Tensor base = at::arange(12, at::kFloat).reshape({3, 4});
  const at::Tensor param = at::ones({2}).requires_grad_(true);
  save_safetensors(path("t.safetensors"),
                   {{"t", base.t()}, {"col", base.select(1, 2)}, {"p", param}});
  const auto file = SafetensorsFile::open(path("t.safetensors"));
  expect_identical(file->load("t"), base.t().contiguous());
  expect_identical(file->load("col"), at::tensor({2.0f, 6.0f, 10.0f}));
  expect_identical(file->load("p"), at::ones({2}));
}

TEST_F(SafetensorsRoundTrip, UnknownNameErrorsNameFileAndTensor) {
  save_safetensors(path("n.safetensors"), {{"a", at::ones({1})}});
  const auto file = SafetensorsFile::open(path("n.safetensors"));
  EXPECT_TRUE(file->contains("a"));
  EXPECT_FALSE(file->contains("b"));
  for (auto action : std::vector<std::function<void()>>{
           [&] { file->info("b"); }, [&] { file->load("b"); }, [&] { file->view("b"); }}) {
    const std::string message = error_of(action);
    EXPECT_THAT(message, HasSubstr(path("n.safetensors")));
    EXPECT_THAT(message, HasSubstr("no tensor named 'b'"));
  }
}

// ---- Sharded checkpoints.

NamedTensors five_blocks() {
  NamedTensors tensors;
  for (int i = 0; i < 5; ++i) {
    tensors.emplace_back("layers." + std::to_string(i) + ".weight",
                         at::full({4, 4}, float(i) + 0.5f));  // 64 bytes each
  }
  return tensors;
}

TEST_F(SafetensorsRoundTrip, ShardedSaveLoadsBackThroughDirAndIndex) {
  const NamedTensors tensors = five_blocks();
  const std::string dir = path("ckpt");
  save_safetensors_sharded(dir, tensors, 150, {{"step", "7"}});  // 2 + 2 + 1 tensors

  const std::vector<std::string> shard_names = {"model-00001-of-00003.safetensors",
                                                "model-00002-of-00003.safetensors",
                                                "model-00003-of-00003.safetensors"};
  for (const auto& name : shard_names) EXPECT_TRUE(fs::exists(dir + "/" + name)) << name;
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
  EXPECT_EQ(SafetensorsFile::open(dir + "/" + shard_names[1])->metadata().at("step"), "7");

  const auto index = nlohmann::json::parse(read_bytes(dir + "/model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], 320);
  EXPECT_EQ(index["weight_map"]["layers.0.weight"], shard_names[0]);
  EXPECT_EQ(index["weight_map"]["layers.1.weight"], shard_names[0]);
  EXPECT_EQ(index["weight_map"]["layers.2.weight"], shard_names[1]);
  EXPECT_EQ(index["weight_map"]["layers.4.weight"], shard_names[2]);

  for (const std::string& where : {dir, dir + "/model.safetensors.index.json"}) {
    SCOPED_TRACE(where);
    const SafetensorsCheckpoint checkpoint = SafetensorsCheckpoint::open(where);
    EXPECT_EQ(checkpoint.files().size(), 3u);
    std::vector<std::string> expected_names;
    for (const auto& [name, tensor] : tensors) {
      expected_names.push_back(name);
      EXPECT_TRUE(checkpoint.contains(name));
      expect_identical(checkpoint.load(name), tensor);
      expect_identical(checkpoint.view(name), tensor);
      expect_identical(checkpoint.load_slice(name, 1, 1, 2, at::kDouble),
                       tensor.narrow(1, 1, 2).to(at::kDouble));
      EXPECT_EQ(checkpoint.info(name).shape, (std::vector<int64_t>{4, 4}));
    }
    EXPECT_EQ(checkpoint.names(), expected_names);
    EXPECT_THAT(error_of([&] { checkpoint.info("missing"); }),
                HasSubstr(where + ": checkpoint has no tensor named 'missing'"));
  }
}

TEST_F(SafetensorsRoundTrip, SmallCheckpointIsOneFileAndReplacesStaleIndex) {
  const std::string dir = path("ckpt");
  save_safetensors_sharded(dir, five_blocks(), 100);  // five shards first
  ASSERT_TRUE(fs::exists(dir + "/model.safetensors.index.json"));

  const NamedTensors small = {{"a", at::ones({2})}, {"b", at::zeros({3}, at::kLong)}};
  save_safetensors_sharded(dir, small, 1 << 20);
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors.index.json"));
  for (const std::string& where : {dir, dir + "/model.safetensors"}) {
    const SafetensorsCheckpoint checkpoint = SafetensorsCheckpoint::open(where);
    EXPECT_EQ(checkpoint.names(), (std::vector<std::string>{"a", "b"}));
    expect_identical(checkpoint.load("b"), small[1].second);
  }

  save_safetensors_sharded(dir, five_blocks(), 100);  // and back: model.safetensors goes away
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
  EXPECT_EQ(SafetensorsCheckpoint::open(dir).names().size(), 5u);
}

TEST_F(SafetensorsRoundTrip, OversizedTensorGetsItsOwnShard) {
  const std::string dir = path("ckpt");
  save_safetensors_sharded(
      dir, {{"small", at::ones({2})}, {"big", at::ones({100})}, {"tail", at::ones({3})}}, 64);
  EXPECT_TRUE(fs::exists(dir + "/model-00003-of-00003.safetensors"));
  const SafetensorsCheckpoint checkpoint = SafetensorsCheckpoint::open(dir);
  EXPECT_EQ(checkpoint.files()[1]->tensors().size(), 1u);
  EXPECT_EQ(checkpoint.files()[1]->tensors()[0].name, "big");
}

// ---- Atomic writes.

std::vector<std::string> entries_of(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

TEST_F(SafetensorsRoundTrip, SaveLeavesNoTempFile) {
  save_safetensors(path("a.safetensors"), {{"x", at::ones({5})}});
  save_safetensors(path("a.safetensors"), {{"y", at::ones({6})}});  // replace
  EXPECT_EQ(entries_of(dir_), std::vector<std::string>{"a.safetensors"});
  EXPECT_TRUE(SafetensorsFile::open(path("a.safetensors"))->contains("y"));
  save_safetensors_sharded(path("ckpt"), five_blocks(), 100);
  EXPECT_EQ(entries_of(path("ckpt")).size(), 6u);  // 5 shards + index
}

TEST_F(SafetensorsRoundTrip, InvalidTensorListLeavesExistingFileIntact) {
  const std::string target = path("keep.safetensors");
  save_safetensors(target, {{"x", at::arange(10, at::kFloat)}});
  const std::string before = read_bytes(target);

  const at::Tensor t = at::ones({2});
  EXPECT_THAT(error_of([&] {
                save_safetensors(target, {{"a", t}, {"b", t}, {"a", t}});
              }),
              HasSubstr(target + ": duplicate tensor name 'a'"));
  EXPECT_THAT(error_of([&] {
                save_safetensors(target, {{"a", at::Tensor()}});
              }),
              HasSubstr("tensor 'a' is undefined"));
  EXPECT_THAT(error_of([&] { save_safetensors(target, {{"", t}}); }), HasSubstr("empty name"));
  EXPECT_THAT(error_of([&] {
                save_safetensors(target, {{"__metadata__", t}});
              }),
              HasSubstr("named __metadata__"));
  EXPECT_THAT(error_of([&] {
                save_safetensors(target, {{"c", at::ones({2}, at::kComplexFloat)}});
              }),
              HasSubstr("which safetensors cannot store"));
  EXPECT_THAT(error_of([&] {
                save_safetensors(target, {{std::string("bad\xff", 4), t}});
              }),
              HasSubstr("is not valid UTF-8"));
  EXPECT_EQ(read_bytes(target), before);
  EXPECT_EQ(entries_of(dir_), std::vector<std::string>{"keep.safetensors"});

  EXPECT_THAT(error_of([&] {
                save_safetensors_sharded(path("ckpt"), {{"a", t}, {"a", t}}, 4);
              }),
              HasSubstr("duplicate tensor name 'a'"));
  EXPECT_FALSE(fs::exists(path("ckpt")));
}

TEST_F(SafetensorsRoundTrip, WriteFailureIsAnErrorNamingThePath) {
  const std::string target = path("no_such_dir/x.safetensors");
  EXPECT_THAT(error_of([&] {
                save_safetensors(target, {{"a", at::ones({1})}});
              }),
              HasSubstr(target + ".tmp."));
  EXPECT_EQ(entries_of(dir_), std::vector<std::string>{});
}

}  // namespace
}  // namespace weft
