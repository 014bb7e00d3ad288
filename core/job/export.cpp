#include "core/job/export.h"

#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/data/dataset.h"
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
                              {"steps", steps}};
  write_file_atomically(dir + "/run.json", run.dump(2) + "\n");
}

}  // namespace weft
