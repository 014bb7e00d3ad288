// GGUF files (core/io/gguf.h): what a valid file holds, read back, and every malformed header
// refused with one line naming the file and the problem. The values of every type against gguf-py
// and transformers, on the bundled pretrained model too: Reference.GgufReadsAsGgufPyAndTransformersDo.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/io/gguf.h"
#include "core/io/gguf_writer.h"
#include "core/model/gguf_model.h"
#include "io_test_util.h"

namespace {

using ::testing::HasSubstr;
using weft::testing::error_of;
using weft::testing::write_bytes;

// A GGUF file assembled field by field, little-endian.
struct Gguf {
  std::string bytes;
  template <typename T>
  Gguf& raw(T value) {
    bytes.append(reinterpret_cast<const char*>(&value), sizeof(value));
    return *this;
  }
  Gguf& str(const std::string& s) {
    raw<uint64_t>(s.size());
    bytes += s;
    return *this;
  }
  Gguf& header(uint64_t tensors, uint64_t keys, uint32_t version = 3) {
    bytes = "GGUF";
    return raw<uint32_t>(version).raw<uint64_t>(tensors).raw<uint64_t>(keys);
  }
  Gguf& key_u32(const std::string& key, uint32_t v) { return str(key).raw<uint32_t>(4).raw<uint32_t>(v); }
  Gguf& key_str(const std::string& key, const std::string& v) { return str(key).raw<uint32_t>(8).str(v); }
  // A tensor's entry: name, dimensions (innermost first), type, offset.
  Gguf& tensor(const std::string& name, const std::vector<uint64_t>& ne, uint32_t type, uint64_t offset) {
    str(name).raw<uint32_t>(static_cast<uint32_t>(ne.size()));
    for (uint64_t n : ne) raw<uint64_t>(n);
    return raw<uint32_t>(type).raw<uint64_t>(offset);
  }
  Gguf& align(size_t to = 32) {
    while (bytes.size() % to != 0) bytes.push_back('\0');
    return *this;
  }
  Gguf& floats(const std::vector<float>& values) {
    for (float v : values) raw<float>(v);
    return *this;
  }
};

class GgufTest : public weft::testing::TempDirTest {
 protected:
  std::string write(const Gguf& file, const std::string& name = "model.gguf") {
    const std::string p = path(name);
    write_bytes(p, file.bytes);
    return p;
  }
  std::string refusal(const Gguf& file) {
    const std::string p = write(file);
    const std::string message = error_of([&] { weft::GgufFile::open(p); });
    EXPECT_THAT(message, HasSubstr(p + ": not a valid GGUF file: "));
    return message;
  }
};

TEST_F(GgufTest, AValidFileReadsBackItsMetadataAndTensors) {
  Gguf g;
  g.header(2, 5)
      .key_str("general.architecture", "llama")
      .key_u32("llama.block_count", 2)
      .str("llama.rope.freq_base").raw<uint32_t>(6).raw<float>(100000.0f)
      .str("tokenizer.ggml.add_bos_token").raw<uint32_t>(7).raw<uint8_t>(0)
      .str("tokenizer.ggml.tokens").raw<uint32_t>(9).raw<uint32_t>(8).raw<uint64_t>(3).str("a").str("bc").str("<s>");
  g.tensor("w", {2, 3}, weft::kGgmlF32, 0).tensor("v", {4}, weft::kGgmlF32, 32);
  g.align().floats({1, 2, 3, 4, 5, 6}).align().floats({-1, -2, -3, -4});
  const auto file = weft::GgufFile::open(write(g));
  EXPECT_EQ(file->version(), 3u);
  EXPECT_EQ(file->get_string("general.architecture"), "llama");
  EXPECT_EQ(file->get_int("llama.block_count"), 2);
  EXPECT_EQ(file->get_float("llama.rope.freq_base"), 100000.0);
  EXPECT_EQ(file->get_bool("tokenizer.ggml.add_bos_token"), false);
  EXPECT_EQ(file->value("tokenizer.ggml.tokens")->texts, (std::vector<std::string>{"a", "bc", "<s>"}));
  EXPECT_EQ(file->get_int("absent"), std::nullopt);
  EXPECT_THAT(error_of([&] { (void)file->get_int("general.architecture"); }),
              HasSubstr("GGUF metadata 'general.architecture' is a string where an integer is expected"));
  ASSERT_EQ(file->tensors().size(), 2u);
  const weft::GgufTensor* w = file->find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->shape, (std::vector<int64_t>{3, 2}));  // outermost first
  std::vector<float> values(6);
  file->dequantize(*w, values.data());
  EXPECT_EQ(values, (std::vector<float>{1, 2, 3, 4, 5, 6}));
  file->dequantize(*file->find("v"), values.data());
  EXPECT_EQ(std::vector<float>(values.begin(), values.begin() + 4), (std::vector<float>{-1, -2, -3, -4}));
}

TEST_F(GgufTest, MalformedHeadersAreRefusedInOneLineNamingTheProblem) {
  struct Case {
    std::string what;
    Gguf file;
    std::string expected;
  };
  std::vector<Case> cases;
  const auto add = [&](const std::string& what, Gguf g, const std::string& expected) { cases.push_back({what, g, expected}); };
  add("empty", Gguf{}, "the magic needs 4 bytes at byte 0, but the file ends 0 bytes later");
  {
    Gguf g;
    g.bytes = "GGML";
    g.raw<uint32_t>(3);
    add("magic", g, "it does not start with the magic \"GGUF\"");
  }
  add("version 1", Gguf{}.header(0, 0, 1), "version 1 (weft reads versions 2 and 3, little-endian)");
  add("big-endian", Gguf{}.header(0, 0, 0x03000000), "version 50331648");
  add("keys", Gguf{}.header(0, 1u << 30), "1073741824 metadata entries do not fit in the file");
  add("key length", Gguf{}.header(0, 1).raw<uint64_t>(1u << 30).raw<uint64_t>(0), "a metadata key needs 1073741824 bytes");
  add("value type", Gguf{}.header(0, 1).str("k").raw<uint32_t>(13).raw<uint64_t>(0), "metadata 'k' has unknown value type 13");
  add("bool", Gguf{}.header(0, 1).str("k").raw<uint32_t>(7).raw<uint8_t>(2).raw<uint64_t>(0), "is a bool of value 2");
  add("array", Gguf{}.header(0, 1).str("k").raw<uint32_t>(9).raw<uint32_t>(6).raw<uint64_t>(1u << 20),
      "metadata 'k' is an array of 1048576 float32 values, more than the 0 bytes left could hold");
  add("array type", Gguf{}.header(0, 1).str("k").raw<uint32_t>(9).raw<uint32_t>(77).raw<uint64_t>(1),
      "metadata 'k' is an array of unknown type 77");
  add("nested", [] {
        Gguf g;
        g.header(0, 1).str("k").raw<uint32_t>(9);  // an array of arrays of arrays ...
        for (int i = 0; i < 10; ++i) g.raw<uint32_t>(9).raw<uint64_t>(1);
        g.raw<uint32_t>(4).raw<uint64_t>(0);
        return g;
      }(), "metadata 'k' nests arrays more than 8 deep");
  add("duplicate key", Gguf{}.header(0, 2).key_u32("k", 1).key_u32("k", 2), "metadata 'k' appears twice");
  add("alignment", Gguf{}.header(0, 1).key_u32("general.alignment", 24), "general.alignment must be a power of two");
  add("tensors", Gguf{}.header(1u << 30, 0), "1073741824 tensors do not fit in the file");
  add("dimensions", Gguf{}.header(1, 0).tensor("t", {1, 1, 1, 1, 1}, 0, 0), "tensor 't' has 5 dimensions (1 to 4)");
  add("zero", Gguf{}.header(1, 0).tensor("t", {4, 0}, 0, 0), "tensor 't' has a dimension of 0");
  add("overflow", Gguf{}.header(1, 0).tensor("t", {1u << 30, 1u << 30, 1u << 30}, 0, 0), "has a dimension of 1073741824");
  add("type", Gguf{}.header(1, 0).tensor("t", {4}, 99, 0), "tensor 't' has ggml type 99, which ggml does not define");
  add("blocks", Gguf{}.header(1, 0).tensor("t", {31, 2}, weft::kGgmlQ4_0, 0),
      "tensor 't' is Q4_0 with rows of 31 values, not whole blocks of 32");
  add("aligned", Gguf{}.header(1, 0).tensor("t", {4}, 0, 4), "tensor 't' starts at offset 4, not a multiple of the alignment 32");
  add("past the end", Gguf{}.header(1, 0).tensor("t", {16}, 0, 0).align().floats({1, 2, 3}),
      "tensor 't' (64 bytes at offset 0) runs past the end of the data region (12 bytes)");
  add("overlap", Gguf{}.header(2, 0).tensor("a", {16}, 0, 0).tensor("b", {8}, 0, 32).align().floats(std::vector<float>(24)),
      "tensors 'a' and 'b' overlap");
  add("duplicate tensor", Gguf{}.header(2, 0).tensor("a", {8}, 0, 0).tensor("a", {8}, 0, 32).align().floats(std::vector<float>(16)),
      "tensor 'a' appears twice");
  add("truncated", [] {
        Gguf g;
        g.header(1, 0).tensor("tensor", {8}, 0, 0);
        g.bytes.resize(g.bytes.size() - 6);
        return g;
      }(), "a tensor's offset needs 8 bytes");
  for (const Case& c : cases) EXPECT_THAT(refusal(c.file), HasSubstr(c.expected)) << c.what;
}

TEST_F(GgufTest, ATypeWeftDoesNotDequantizeIsNamedWhenRead) {
  Gguf g;
  g.header(1, 0).tensor("blk.0.attn_q.weight", {256}, 10 /* Q2_K */, 0).align();
  g.bytes.append(84, '\0');
  const auto file = weft::GgufFile::open(write(g));
  std::vector<float> out(256);
  EXPECT_THAT(error_of([&] { file->dequantize(file->tensors()[0], out.data()); }),
              HasSubstr("tensor 'blk.0.attn_q.weight' is Q2_K, a type weft does not dequantize (F32, F16, BF16, Q8_0, "
                        "Q4_0, Q4_1, Q4_K, Q5_K, Q6_K)"));
}

// The model's shape from the metadata; what is not a Llama weft builds is named.
TEST_F(GgufTest, TheModelShapeComesFromTheMetadata) {
  const auto llama = [](const std::string& arch, bool block_count) {
    Gguf g;
    g.header(1, block_count ? 7 : 6).key_str("general.architecture", arch);
    if (block_count) g.key_u32(arch + ".block_count", 2);
    g.key_u32(arch + ".embedding_length", 8).key_u32(arch + ".feed_forward_length", 16)
        .key_u32(arch + ".attention.head_count", 2).key_u32(arch + ".attention.head_count_kv", 1)
        .key_u32("tokenizer.ggml.eos_token_id", 2);
    g.tensor("token_embd.weight", {8, 10}, 0, 0).align().floats(std::vector<float>(80));
    return g;
  };
  const auto config = weft::load_gguf_model_config(write(llama("llama", true)));
  EXPECT_EQ(config.num_hidden_layers, 2);
  EXPECT_EQ(config.hidden_size, 8);
  EXPECT_EQ(config.intermediate_size, 16);
  EXPECT_EQ(config.num_attention_heads, 2);
  EXPECT_EQ(config.num_key_value_heads, 1);
  EXPECT_EQ(config.head_dim, 4);
  EXPECT_EQ(config.vocab_size, 10);
  EXPECT_TRUE(config.tie_word_embeddings);  // no output.weight
  EXPECT_EQ(config.eos_token_id, 2);
  EXPECT_EQ(config.bos_token_id, std::nullopt);
  const std::string qwen = write(llama("qwen2", true), "qwen.gguf");
  EXPECT_THAT(error_of([&] { weft::load_gguf_model_config(qwen); }),
              HasSubstr("GGUF architecture 'qwen2' is not one weft builds (llama)"));
  const std::string partial = write(llama("llama", false), "partial.gguf");
  EXPECT_THAT(error_of([&] { weft::load_gguf_model_config(partial); }), HasSubstr("GGUF metadata has no llama.block_count"));
}

}  // namespace

namespace {

uint16_t bits16(const std::vector<uint8_t>& bytes, size_t i) {
  uint16_t v;
  std::memcpy(&v, bytes.data() + 2 * i, 2);
  return v;
}

// Every 65,537th fp32 bit pattern (all exponents, both signs, subnormals, infinities, NaNs) and the
// cases at the edges of half's range.
std::vector<float> float_sweep() {
  std::vector<float> out;
  for (uint64_t b = 0; b <= 0xffffffffull; b += 65537) {
    const auto bits = static_cast<uint32_t>(b);
    float f;
    std::memcpy(&f, &bits, 4);
    out.push_back(f);
  }
  for (float f : {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, 1e-8f, 5.96e-8f, 2.98e-8f, 2.9802322e-08f, 6.1035156e-05f,
                  1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048, std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min()}) {
    out.push_back(f);
    out.push_back(-f);
  }
  return out;
}

}  // namespace

// F16 rounds as IEEE (and numpy's astype(float16)) does: to nearest even, with subnormals,
// overflow to infinity and NaN kept NaN; BF16 as ggml (and gguf-py) does: to nearest even, NaN
// made quiet. c10's conversions are the reference here; gguf_reference.py checks the writer's
// bytes against gguf-py's on a real model.
TEST(GgufWriter, HalfAndBfloat16RoundToNearestEven) {
  const auto values = float_sweep();
  const auto half = weft::quantize_ggml(weft::kGgmlF16, values.data(), static_cast<int64_t>(values.size()));
  const auto bf16 = weft::quantize_ggml(weft::kGgmlBF16, values.data(), static_cast<int64_t>(values.size()));
  ASSERT_EQ(half.size(), 2 * values.size());
  int64_t checked = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const float v = values[i];
    const c10::Half h(v);
    const c10::BFloat16 b(v);
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(static_cast<float>(c10::Half(bits16(half, i), c10::Half::from_bits())))) << v;
      EXPECT_EQ(bits16(bf16, i) & 0x7fc0, 0x7fc0) << v;  // a quiet NaN
      continue;
    }
    ASSERT_EQ(bits16(half, i), h.x) << "F16 of " << v;
    ASSERT_EQ(bits16(bf16, i), b.x) << "BF16 of " << v;
    ++checked;
  }
  EXPECT_GT(checked, 60000);
}

// A file the writer wrote reads back: every kind of metadata value (a copied GgufValue keeps its
// types), the tensors' shapes (outermost first) and values (Q8_0 within half a step of its block).
TEST_F(GgufTest, TheWriterWritesWhatTheReaderReadsBack) {
  weft::GgufWriter out;
  out.set("general.architecture", weft::GgufWriter::string("llama"));
  out.set("llama.block_count", weft::GgufWriter::u32(7));
  out.set("llama.rope.freq_base", weft::GgufWriter::f32(500000.0f));
  out.set("tokenizer.ggml.add_bos_token", weft::GgufWriter::boolean(true));
  out.set("tokenizer.ggml.tokens", weft::GgufWriter::strings({"a", "bc", "<|x|>"}));
  out.set("tokenizer.ggml.token_type", weft::GgufWriter::i32s({1, 1, 3}));
  out.set("scores", weft::GgufWriter::f32s({0.5f, -1.0f}));
  out.set("llama.block_count", weft::GgufWriter::u32(2));  // replaced in place
  std::vector<float> w(3 * 64);
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::sin(0.37f * static_cast<float>(i)) * (i % 7 == 0 ? 40.0f : 1.0f);
  for (uint32_t type : {weft::kGgmlF32, weft::kGgmlF16, weft::kGgmlBF16, weft::kGgmlQ8_0}) {
    out.add_tensor("w." + weft::ggml_type_name(type), {3, 64}, type, weft::quantize_ggml(type, w.data(), 192));
  }
  out.add_tensor("norm", {5}, weft::kGgmlF32, weft::quantize_ggml(weft::kGgmlF32, w.data(), 5));
  EXPECT_THAT(error_of([&] { out.add_tensor("norm", {5}, weft::kGgmlF32, weft::quantize_ggml(weft::kGgmlF32, w.data(), 5)); }),
              HasSubstr("GGUF tensor 'norm' added twice"));
  EXPECT_THAT(error_of([&] { (void)weft::quantize_ggml(weft::kGgmlQ8_0, w.data(), 40); }),
              HasSubstr("40 values are not whole blocks of Q8_0"));
  EXPECT_THAT(error_of([&] { (void)weft::quantize_ggml(weft::kGgmlQ4_K, w.data(), 256); }),
              HasSubstr("weft does not write GGUF tensors of type Q4_K"));
  out.write(path("written.gguf"));

  const auto file = weft::GgufFile::open(path("written.gguf"));
  EXPECT_EQ(file->keys(), (std::vector<std::string>{"general.architecture", "llama.block_count", "llama.rope.freq_base",
                                                    "tokenizer.ggml.add_bos_token", "tokenizer.ggml.tokens",
                                                    "tokenizer.ggml.token_type", "scores"}));
  EXPECT_EQ(file->get_int("llama.block_count"), 2);
  EXPECT_EQ(file->get_float("llama.rope.freq_base"), 500000.0);
  EXPECT_EQ(file->get_bool("tokenizer.ggml.add_bos_token"), true);
  EXPECT_EQ(file->value("tokenizer.ggml.tokens")->texts, (std::vector<std::string>{"a", "bc", "<|x|>"}));
  EXPECT_EQ(file->value("tokenizer.ggml.token_type")->integers, (std::vector<int64_t>{1, 1, 3}));
  EXPECT_EQ(file->value("scores")->numbers, (std::vector<double>{0.5, -1.0}));
  for (uint32_t type : {weft::kGgmlF32, weft::kGgmlF16, weft::kGgmlBF16, weft::kGgmlQ8_0}) {
    const weft::GgufTensor* t = file->find("w." + weft::ggml_type_name(type));
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->type, type);
    EXPECT_EQ(t->shape, (std::vector<int64_t>{3, 64}));
    std::vector<float> back(192);
    file->dequantize(*t, back.data());
    for (size_t i = 0; i < back.size(); ++i) {
      const float block_max = 40.0f;  // the largest magnitude in any block of 32
      const float tolerance = type == weft::kGgmlF32  ? 0.0f
                              : type == weft::kGgmlF16 ? std::abs(w[i]) * 1e-3f
                              : type == weft::kGgmlBF16 ? std::abs(w[i]) * 8e-3f
                                                        : block_max / 127.0f / 2.0f * 1.01f;
      ASSERT_LE(std::abs(back[i] - w[i]), tolerance) << weft::ggml_type_name(type) << " value " << i;
    }
  }
  // Copying every value of the file into a second one gives the same metadata.
  weft::GgufWriter copy;
  for (const auto& key : file->keys()) copy.set(key, *file->value(key));
  copy.write(path("copy.gguf"));
  const auto again = weft::GgufFile::open(path("copy.gguf"));
  EXPECT_EQ(again->keys(), file->keys());
  EXPECT_EQ(again->value("tokenizer.ggml.token_type")->element_type, 5u);  // int32, as written
  EXPECT_EQ(again->value("scores")->numbers, (std::vector<double>{0.5, -1.0}));
}
