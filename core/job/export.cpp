#include "core/job/export.h"

#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/data/dataset.h"
#include "core/data/loader.h"
#include "core/data/tokenizer.h"
#include "core/model/config.h"
#include "core/job/job.h"
#include "core/util/device.h"
#include "core/util/error.h"
#include "core/util/fs.h"

namespace weft {

void export_job(const TrainOptions& options, const std::string& dir, int64_t steps) {
  const auto tokenizer = load_tokenizer(options.tokenizer);
  const ModelConfig model = resolve_model_config(options, tokenizer.get());
  const DatasetSplits data = prepare_dataset(options.data, *tokenizer);
  const int64_t steps_per_epoch = data.train->n_sequences() / (options.batch_size * options.grad_accum_steps);
  WEFT_CHECK(steps_per_epoch > 0, "the training split has {} sequences, fewer than one step's {} x {}",
             data.train->n_sequences(), options.batch_size, options.grad_accum_steps);
  std::filesystem::create_directories(dir);
  write_file_atomically(dir + "/config.json", to_hf_config_json(model));
  const auto& tokens = data.train->tokens();
  write_file_atomically(dir + "/tokens.u32", std::string(reinterpret_cast<const char*>(tokens.data()),
                                                         tokens.size() * sizeof(uint32_t)));
  // The sequences of weft's global batches, in order, for `steps` steps (epochs reshuffled as weft does).
  const BatchLoader loader(data.train, options.batch_size, /*rank=*/0, /*world=*/1, options.seed, /*shuffle=*/true);
  std::vector<uint32_t> order;
  for (int64_t step = 0; step < steps; ++step) {
    for (int64_t micro = 0; micro < options.grad_accum_steps; ++micro) {
      const int64_t epoch = step / steps_per_epoch, index = (step % steps_per_epoch) * options.grad_accum_steps + micro;
      for (const int64_t sequence : loader.sequence_indices(epoch, index)) order.push_back(static_cast<uint32_t>(sequence));
    }
  }
  write_file_atomically(dir + "/order.u32", std::string(reinterpret_cast<const char*>(order.data()),
                                                        order.size() * sizeof(uint32_t)));
  const nlohmann::json run = {{"seq_len", options.data.seq_len},
                              {"batch_size", options.batch_size},
                              {"grad_accum_steps", options.grad_accum_steps},
                              {"lr", options.optim.lr},
                              {"weight_decay", options.optim.weight_decay},
                              {"beta1", options.optim.beta1},
                              {"beta2", options.optim.beta2},
                              {"eps", options.optim.eps},
                              {"warmup_steps", options.optim.warmup_steps},
                              {"grad_clip", options.optim.grad_clip},
                              {"seed", options.seed},
                              {"threads", options.threads},
                              {"precision", options.precision},
                              {"device", resolve_device(options.device, 0, 0, this_process_devices()).is_cuda()
                                             ? "cuda" : "cpu"},
                              {"steps_per_epoch", steps_per_epoch},
                              {"steps", steps},
                              {"mode", options.mode},
                              {"weights", options.model.weights.empty()
                                              ? std::string()
                                              : std::filesystem::absolute(options.model.weights).string()},
                              {"lora",
                               {{"r", options.lora.spec.r},
                                {"alpha", options.lora.spec.alpha},
                                {"dropout", options.lora.spec.dropout},
                                {"target_modules", options.lora.target_modules}}}};
  write_file_atomically(dir + "/run.json", run.dump(2) + "\n");
}

}  // namespace weft
