// Encodes files with weft's tokenizer and prints the ids of each as a JSON array of arrays on
// stdout, and the encoding speed on stderr. Built with the tests (tests/CMakeLists.txt); the
// tokenizer test runs it next to the reference encoders (tools/llama3_tokenizer.py check):
//   tokenizer_encode SPEC FILE...     (SPEC as for weft::load_tokenizer)
//   tokenizer_encode SPEC --chat CONVERSATIONS.json
//       renders each conversation (a list of {role, content}) with the tokenizer's chat template,
//       with add_generation_prompt false and true, and prints [[text, ids], [text, ids]] per
//       conversation (ids: the text encoded as the template wrote it, no BOS added).
//   tokenizer_encode SPEC --sft CHAT.jsonl LOSS_ON SEQ_LEN [packed]
//       prepares instruction data as training does (data.format = "chat", data.loss_on = LOSS_ON,
//       no held-out split; "packed": data.packing) and prints each row as [inputs, targets] (targets
//       -100 where the loss does not count; packed: [inputs, targets, positions]), and
//       {"truncated": N, "dropped": N} on stderr's last line.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/data/chat_data.h"
#include "core/data/chat_template.h"
#include "core/data/loader.h"
#include "core/data/tokenizer.h"
#include "core/util/error.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: tokenizer_encode SPEC FILE...\n";
    return 2;
  }
  try {
    const auto tokenizer = weft::load_tokenizer(argv[1]);
    const auto id_text = [](std::optional<int32_t> id) { return id ? std::to_string(*id) : std::string("none"); };
    std::fprintf(stderr, "%s: kind %s, vocab_size %lld, bos %s, eos %s, fingerprint %s\n", argv[1],
                 tokenizer->kind().c_str(), static_cast<long long>(tokenizer->vocab_size()),
                 id_text(tokenizer->bos_id()).c_str(), id_text(tokenizer->eos_id()).c_str(),
                 tokenizer->fingerprint().c_str());
    nlohmann::json all = nlohmann::json::array();
    if (std::string(argv[2]) == "--chat" && argc == 4) {
      const auto chat = weft::load_chat_template(argv[1], *tokenizer);
      if (!chat) weft::fail("{}: no chat template", argv[1]);
      std::ifstream in(argv[3]);
      for (const auto& conversation : nlohmann::json::parse(in)) {
        std::vector<weft::ChatMessage> messages;
        for (const auto& m : conversation) messages.push_back({m.at("role"), m.at("content")});
        nlohmann::json both = nlohmann::json::array();
        for (bool generation_prompt : {false, true}) {
          const std::string text = chat->render(messages, generation_prompt);
          both.push_back({text, tokenizer->encode(text)});
        }
        all.push_back(both);
      }
      std::cout << all.dump() << "\n";
      return 0;
    }
    if (std::string(argv[2]) == "--sft" && (argc == 6 || (argc == 7 && std::string(argv[6]) == "packed"))) {
      const auto chat = weft::load_chat_template(argv[1], *tokenizer);
      weft::DatasetOptions options;
      options.paths = {argv[3]};
      options.seq_len = std::stoll(argv[5]);
      weft::ChatOptions chat_options;
      chat_options.loss_on = argv[4];
      chat_options.packing = argc == 7;
      const weft::ChatData data = weft::prepare_chat(options, chat_options, *tokenizer, chat.get());
      const auto& rows = *data.splits.train;
      std::vector<int64_t> all(static_cast<size_t>(rows.n_sequences()));
      for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
      const weft::Batch batch = weft::make_batch(rows, all);
      for (int64_t r = 0; r < batch.rows(); ++r) {
        const auto row = [&](const at::Tensor& t) {
          const auto x = t[r].contiguous();
          return std::vector<int64_t>(x.data_ptr<int64_t>(), x.data_ptr<int64_t>() + x.numel());
        };
        auto line = nlohmann::json::array({row(batch.inputs), row(batch.targets)});
        if (batch.positions.defined()) line.push_back(row(batch.positions));
        std::cout << line.dump() << "\n";
      }
      std::cerr << nlohmann::json{{"truncated", data.truncated}, {"dropped", data.dropped}}.dump() << "\n";
      return 0;
    }
    for (int i = 2; i < argc; ++i) {
      std::ifstream in(argv[i], std::ios::binary);
      if (!in) weft::fail("cannot open {}", argv[i]);
      std::stringstream text;
      text << in.rdbuf();
      const auto start = std::chrono::steady_clock::now();
      const auto ids = tokenizer->encode(text.str());
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::fprintf(stderr, "%s: %zu bytes -> %zu tokens in %.3f s (%.1f MB/s)\n", argv[i], text.str().size(),
                   ids.size(), seconds, text.str().size() / seconds / 1e6);
      if (tokenizer->decode(ids) != text.str()) weft::fail("{}: decode(encode(text)) differs from the text", argv[i]);
      all.push_back(ids);
    }
    std::cout << all.dump() << "\n";
  } catch (const std::exception& e) {
    std::cerr << "tokenizer_encode: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
