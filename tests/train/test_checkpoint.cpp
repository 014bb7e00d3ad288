// What a run leaves in its directory: leftovers of interrupted saves are cleaned up before the run
// saves anything, a model directory moved aside by a crash is put back, and a saved config.json
// names the tokenizer's special tokens.
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/data/byte_tokenizer.h"
#include "core/train/trainer.h"
#include "tests/train/train_test_util.h"

namespace weft {
namespace {

namespace fs = std::filesystem;

void make_dir_with_file(const fs::path& dir) {
  fs::create_directories(dir);
  std::ofstream(dir / "model.safetensors") << "partial";
}

TEST(Checkpoints, LeftoversOfInterruptedSavesAreRemovedBeforeTheRunSaves) {
  const auto dir = testing::fresh_dir("leftovers");
  auto o = testing::tiny_options(dir);
  const fs::path run = o.out_dir, checkpoints = run / "checkpoints";
  make_dir_with_file(checkpoints / ".tmp-step-00000007-999999");          // a save killed half-way
  make_dir_with_file(checkpoints / ".tmp-delete-step-00000001-999999");   // a deletion killed half-way
  std::ofstream(checkpoints / "latest.tmp.999999") << "step-0000";        // the pointer, half-written
  make_dir_with_file(run / "final.tmp-999999");                           // a saved model, half-written
  make_dir_with_file(run / "best.old-999999");    // moved aside, then the crash: nothing replaced it
  make_dir_with_file(run / "final-merged.old-999999");
  make_dir_with_file(run / "final-merged");       // ... replaced: the old one goes
  std::ofstream(run / "notes.tmp.txt") << "the user's";  // not weft's: left alone
  o.overwrite = true;
  Trainer trainer(o);  // before any step or save
  for (const auto& gone : {checkpoints / ".tmp-step-00000007-999999", checkpoints / ".tmp-delete-step-00000001-999999",
                           checkpoints / "latest.tmp.999999", run / "final.tmp-999999", run / "best.old-999999",
                           run / "final-merged.old-999999"}) {
    EXPECT_FALSE(fs::exists(gone)) << gone;
  }
  EXPECT_TRUE(fs::exists(run / "best/model.safetensors"));  // put back where it was
  EXPECT_TRUE(fs::exists(run / "final-merged/model.safetensors"));
  EXPECT_TRUE(fs::exists(run / "notes.tmp.txt"));
}

TEST(Checkpoints, SavedConfigNamesTheTokenizersSpecialTokens) {
  // A preset has no bos/eos ids; the saved HF config.json takes the tokenizer's (it said null).
  const auto dir = testing::fresh_dir("special_tokens");
  auto o = testing::tiny_options(dir);
  o.max_steps = 1;
  o.save_final = true;
  Trainer(o).run();
  std::ifstream in(o.out_dir + "/final/config.json");
  const auto config = nlohmann::json::parse(in);
  EXPECT_EQ(config["bos_token_id"], ByteTokenizer::kBeginOfText) << config.dump();
  EXPECT_EQ(config["eos_token_id"], ByteTokenizer::kEndOfText) << config.dump();
}

}  // namespace
}  // namespace weft

namespace weft {
namespace {

// Found by fuzz_checkpoint_state: a step count written as a float beyond int64 was cast (undefined
// behaviour) instead of refused.
TEST(TrainerStateFuzzFindings, AFloatWhereACountBelongsIsRefused) {
  const std::string text = R"({"global_step": 7.8e117, "epoch": 0, "step_in_epoch": 0, "best_eval_loss": null,
    "best_step": -1, "evals_since_best": 0, "epoch_seconds": 0, "epoch_tokens": 0, "data_identity": ""})";
  try {
    TrainerState::parse(text, "trainer_state.json");
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("trainer_state.json: global_step is not an integer"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace weft
