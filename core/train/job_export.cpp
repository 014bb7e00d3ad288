// Trainer::export_job: the job as files another trainer can read (trainer bench's baseline).
#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/train/trainer.h"
#include "core/util/fs.h"

namespace weft {

void Trainer::export_job(const std::string& dir, int64_t steps) const {
  std::filesystem::create_directories(dir);
  write_file_atomically(dir + "/config.json", to_hf_config_json(model_->config()));
  const auto& tokens = dataset_.train->tokens();
  write_file_atomically(dir + "/tokens.u32", std::string(reinterpret_cast<const char*>(tokens.data()),
                                                         tokens.size() * sizeof(uint32_t)));
  const nlohmann::json run = {{"seq_len", options_.data.seq_len},
                              {"batch_size", options_.batch_size},
                              {"grad_accum_steps", options_.grad_accum_steps},
                              {"lr", options_.optim.lr},
                              {"weight_decay", options_.optim.weight_decay},
                              {"beta1", options_.optim.beta1},
                              {"beta2", options_.optim.beta2},
                              {"eps", options_.optim.eps},
                              {"warmup_steps", options_.optim.warmup_steps},
                              {"grad_clip", options_.optim.grad_clip},
                              {"seed", options_.seed},
                              {"threads", options_.threads},
                              {"precision", options_.precision},
                              {"steps_per_epoch", steps_per_epoch_},
                              {"steps", steps}};
  write_file_atomically(dir + "/run.json", run.dump(2) + "\n");
}

}  // namespace weft
