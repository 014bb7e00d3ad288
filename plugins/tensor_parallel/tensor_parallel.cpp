// tensor_parallel.so - Megatron-LM tensor parallelism (Shoeybi et al. 2019) for the LLaMA
// blocks, on the SDK alone.
//
// Layout: world = tp x dp; world rank = dp_rank * tp + tp_rank. Every rank builds every stage
// but only its slice of each weight (shard_parameter): q/k/v and gate/up column-parallel
// (dim 0), o and down row-parallel (dim 1), embedding and LM head vocabulary-parallel (dim 0),
// norms whole. Attention heads are split over the tp ranks; kv heads too when
// num_key_value_heads % tp == 0, else (tp % num_key_value_heads == 0) each group of
// tp / num_key_value_heads ranks shares one kv head (and sums its gradient over that group).
// Head counts that allow neither are refused in plan.
// Communication (comm_point): Megatron's f before attention, MLP and a vocabulary-parallel head
// (identity forward, all-reduce backward over the tp group), g after them and after the
// vocabulary-parallel embedding (all-reduce forward), and the vocabulary-parallel loss's
// per-token max (all-reduce MAX) and sums (all-reduce SUM) - the full logits are never
// gathered. Tensor-parallel ranks see the same rows; dp replicas average gradients in buckets.
// LoRA and AdaLoRA (train.mode = lora, adalora): adapters follow their base layer's split (the
// host's layout, see weft_parameter_info); the whole factor of a split layer's adapter (and
// AdaLoRA's Lambda) holds this rank's share of its gradient, summed here over the tp group, and
// AdaLoRA's scores over the slices are summed at WEFT_COMM_ADAPTER_SUM (ABI 1.8).
// Sequence parallelism (Korthikanti et al. 2022; plugin.sequence_parallel, ABI 1.9): between the
// tensor-parallel regions each tp rank holds 1/tp of every sequence's tokens (the embedding's
// output, the residual stream, the norms); the host calls sequence_region where f and g would be,
// and this plugin all-gathers the tokens into a region and reduce-scatters its partial sums out of
// it, the same bytes as g's all-reduce in two halves, with the activations between the regions
// divided by tp. The norms' gradients then come from this rank's tokens only: summed over the group.
// Configuration ([plugin]): tp (int >= 1, default: the world size), bucket_mb (float > 0,
// default 25: dp gradient buckets), sequence_parallel (bool, default false).
#include <cmath>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include <weft/strategy.hpp>

#include "../common/dl_views.hpp"
#include "../common/grad_average.hpp"
#include "../common/reductions.hpp"

namespace {

using weft::sdk::Error;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

class TensorParallel : public weft::sdk::Strategy {
 public:
  static constexpr uint16_t min_host_minor = 1;  // model_info, WEFT_COMM_HEAD_INPUT
  // ABI 1.12: the tensor-parallel dimension of a composed run (world = the tp group; dp = 1 here).
  static constexpr uint32_t mesh_dimensions = 1u << WEFT_MESH_TP;

  explicit TensorParallel(weft::sdk::Host host) : Strategy(host), world_(host.world()) {
    const int64_t tp = host.config_int("tp", world_.size());
    if (tp < 1 || world_.size() % tp != 0) {
      throw Error(WEFT_STATUS_BAD_CONFIG, "tensor_parallel: plugin.tp = " + std::to_string(tp) +
                                              " must be >= 1 and divide the world size " + std::to_string(world_.size()));
    }
    tp_ = static_cast<int32_t>(tp);
    dp_ = world_.size() / tp_;
    tp_rank_ = world_.rank() % tp_;
    dp_rank_ = world_.rank() / tp_;
    bucket_mb_ = host.config_float("bucket_mb", 25.0);
    if (!(bucket_mb_ > 0.0)) throw Error(WEFT_STATUS_BAD_CONFIG, "tensor_parallel: plugin.bucket_mb must be > 0");
    sequence_parallel_ = host.config_bool("sequence_parallel", false) && tp_ > 1;
  }

  void plan(weft_model_plan& plan) override {
    const weft_model_info info = host().model_info();
    auto refuse = [&](const std::string& what) {
      throw Error(WEFT_STATUS_BAD_CONFIG, "tensor_parallel: " + what + " cannot be split " + std::to_string(tp_) +
                                              " ways (plugin.tp)");
    };
    if (info.num_attention_heads % tp_ != 0) refuse(std::to_string(info.num_attention_heads) + " attention heads");
    if (info.num_key_value_heads % tp_ != 0 && tp_ % info.num_key_value_heads != 0) {
      refuse(std::to_string(info.num_key_value_heads) + " kv heads (neither divides the other)");
    }
    if (info.intermediate_size % tp_ != 0) refuse("intermediate size " + std::to_string(info.intermediate_size));
    if (info.vocab_size % tp_ != 0) refuse("vocabulary " + std::to_string(info.vocab_size));
    kv_parts_ = info.num_key_value_heads % tp_ == 0 ? tp_ : info.num_key_value_heads;
    plan.data_parallel_size = dp_;
    plan.data_parallel_rank = dp_rank_;
    if (sequence_parallel_) {
      if (plan.struct_size < offsetof(weft_model_plan, tensor_sequence_rank) + sizeof(int32_t)) {
        throw Error(WEFT_STATUS_BAD_CONFIG, "tensor_parallel: plugin.sequence_parallel needs a host of ABI >= 1.9");
      }
      plan.tensor_sequence_size = tp_;
      plan.tensor_sequence_rank = tp_rank_;
    }
  }

  weft_shard shard_parameter(const weft_parameter_info& info) override {
    const std::string name = info.name;
    for (const char* column : {"self_attn.q_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"}) {
      if (ends_with(name, column)) return {0, tp_, tp_rank_};
    }
    for (const char* kv : {"self_attn.k_proj.weight", "self_attn.v_proj.weight"}) {
      if (ends_with(name, kv)) return {0, kv_parts_, tp_rank_ * kv_parts_ / tp_};
    }
    for (const char* row : {"self_attn.o_proj.weight", "mlp.down_proj.weight"}) {
      if (ends_with(name, row)) return {1, tp_, tp_rank_};
    }
    if (name == "model.embed_tokens.weight" || name == "lm_head.weight") return {0, tp_, tp_rank_};
    return {0, 1, 0};
  }

  void setup() override {
    // Groups (collective: every rank creates every group in the same order).
    for (int32_t d = 0; d < dp_; ++d) {
      std::vector<int32_t> ranks;
      for (int32_t t = 0; t < tp_; ++t) ranks.push_back(d * tp_ + t);
      weft::sdk::Group g = host().create_group(ranks);
      if (d == dp_rank_) tp_group_ = g;
    }
    const int32_t sharing = tp_ / kv_parts_;
    for (int32_t d = 0; d < dp_; ++d) {
      for (int32_t k = 0; k < kv_parts_; ++k) {
        std::vector<int32_t> ranks;
        for (int32_t t = k * sharing; t < (k + 1) * sharing; ++t) ranks.push_back(d * tp_ + t);
        weft::sdk::Group g = host().create_group(ranks);
        if (d == dp_rank_ && tp_rank_ / sharing == k) kv_group_ = g;
      }
    }
    weft::sdk::Group dp_group;
    for (int32_t t = 0; t < tp_; ++t) {
      std::vector<int32_t> ranks;
      for (int32_t d = 0; d < dp_; ++d) ranks.push_back(d * tp_ + t);
      weft::sdk::Group g = host().create_group(ranks);
      if (t == tp_rank_) dp_group = g;
    }
    if (dp_ > 1) average_ = std::make_unique<weft::plugins::GradientAverager>(host(), dp_group, bucket_mb_);
    classify_gradients();
  }

  double train_step(const weft_step_info& step) override {
    const double loss = single_process_train_step(step);  // comm points run inside
    if (sum_over_tp_) sum_over_tp_->sum();
    if (sum_over_kv_) sum_over_kv_->sum();
    if (average_) average_->average();
    return mean_over_replicas(loss);
  }

  // Composed (ABI 1.12), after the driver's step (e.g. a pipeline's): the partial gradients of
  // replicated weights summed over the tp group; the loss is already the same on every tp rank.
  double finish_step(const weft_step_info& step, double loss) override {
    (void)step;
    if (sum_over_tp_) sum_over_tp_->sum();
    if (sum_over_kv_) sum_over_kv_->sum();
    if (average_) average_->average();
    return loss;
  }
  // The tp ranks evaluated the same rows: nothing to add.
  weft::sdk::EvalResult finish_eval(const weft_step_info& step, const weft::sdk::EvalResult& sums) override {
    (void)step;
    return sums;
  }
  // How many tp ranks hold each gradient after the step (classify_gradients).
  int32_t gradient_copies(int64_t index) override {
    for (size_t i = 0; i < trainable_.size(); ++i) {
      if (trainable_[i] == index) return static_cast<int32_t>(copies_[i] + 0.5);
    }
    return 1;
  }

  weft::sdk::EvalResult eval_step(const weft_step_info& step) override {
    weft::sdk::EvalResult local = single_process_eval_step(step);  // the same on every tp rank
    std::vector<double> sums{local.loss_sum, static_cast<double>(local.tokens)};
    sum_over(world_, sums);
    weft::sdk::EvalResult result;
    result.loss_sum = sums[0] / tp_;
    result.tokens = static_cast<int64_t>(sums[1] / tp_ + 0.5);
    return result;
  }

  double global_grad_norm_sq(double local_sq) override {
    (void)local_sq;  // recomputed here: each gradient counts once however many tp ranks hold it
    std::vector<double> share{0.0};
    for (size_t i = 0; i < trainable_.size(); ++i) share[0] += squares(trainable_[i]) / copies_[i];
    sum_over(tp_group_, share);
    return share[0];
  }

  void comm_point(weft_comm_point point, weft_direction direction, int64_t layer, DLTensor& tensor) override {
    (void)layer;
    if (tp_ == 1) return;
    const bool forward = direction == WEFT_FORWARD;
    switch (point) {
      case WEFT_COMM_ATTENTION_INPUT:
      case WEFT_COMM_MLP_INPUT:
      case WEFT_COMM_HEAD_INPUT:  // f: identity forward, all-reduce backward
        if (!forward) host().all_reduce(tp_group_, tensor).wait();
        break;
      case WEFT_COMM_ATTENTION_OUTPUT:
      case WEFT_COMM_MLP_OUTPUT:
      case WEFT_COMM_EMBEDDING_OUTPUT:
      case WEFT_COMM_LOSS_SUM:  // g: all-reduce forward, identity backward
      case WEFT_COMM_ADAPTER_SUM:  // AdaLoRA's sums over adapter slices (ABI 1.8; forward only)
        if (forward) host().all_reduce(tp_group_, tensor).wait();
        break;
      case WEFT_COMM_LOSS_MAX:
      case WEFT_COMM_ROW_ABSMAX:  // per-token scales of a row-parallel int8 layer (ABI 1.7)
        if (forward) host().all_reduce(tp_group_, tensor, WEFT_REDUCE_MAX).wait();
        break;
    }
  }

  // Sequence parallelism (ABI 1.9): the shapes say which collective; the tp group is in tp-rank
  // order. The [tp, ...] side is contiguous, so the host's dim-0 collectives over flat views move
  // slice r to or from tp rank r.
  void sequence_region(weft_comm_point point, weft_direction direction, int64_t layer, const DLTensor& input,
                       DLTensor& output) override {
    (void)point;
    (void)direction;
    (void)layer;
    int64_t in_shape[2], out_shape[2];
    const DLTensor in = weft::plugins::flat_contiguous_view(input, in_shape);
    DLTensor out = weft::plugins::flat_contiguous_view(output, out_shape);
    if (output.ndim == input.ndim + 1) {
      host().all_gather(tp_group_, out, in).wait();
    } else {
      host().reduce_scatter(tp_group_, out, in, WEFT_REDUCE_SUM).wait();
    }
  }

 private:
  // After backward, a gradient on this rank is one of: a slice only this tp rank holds
  // (complete); a norm's (whole, complete and equal on every tp rank); a kv slice shared by
  // tp / kv_parts ranks (each holds the part from its own query heads: summed over the kv
  // group); or the whole factor of a LoRA adapter on a split layer (this rank's share: summed
  // over the tp group); under sequence parallelism, a norm's (this rank's tokens' share: summed over
  // the tp group). `copies_` is how many tp ranks then hold each identical gradient.
  void classify_gradients() {
    std::vector<int64_t> tp_partial, kv_partial;
    const int32_t sharing = tp_ / kv_parts_;
    for (int64_t i = 0; i < host().parameter_count(); ++i) {
      const weft_parameter_info info = host().parameter_info(i);
      if (!info.trainable) continue;
      const std::string name = info.name;
      int64_t full = 1;
      for (int32_t d = 0; d < info.ndim; ++d) full *= info.shape[d];
      const bool sliced = weft::plugins::element_count(host().parameter_data(i)) < full;
      // LoRA's factors and AdaLoRA's (P "lora_A", Lambda "lora_E", Q "lora_B").
      const bool lora_a = ends_with(name, ".lora_A.weight") || ends_with(name, ".lora_A");
      const bool lora_b = ends_with(name, ".lora_B.weight") || ends_with(name, ".lora_B");
      const bool lora_e = ends_with(name, ".lora_E");
      const bool kv = name.find("self_attn.k_proj.") != std::string::npos ||
                      name.find("self_attn.v_proj.") != std::string::npos;
      double copies = 1.0;
      if (kv && !lora_a && !lora_e && sharing > 1) {  // k/v weight or its lora_B: laid out like the kv heads
        kv_partial.push_back(i);
        copies = sharing;
      } else if ((lora_a || lora_b || lora_e) && !sliced && tp_ > 1) {
        tp_partial.push_back(i);
        copies = tp_;
      } else if (!sliced) {
        copies = tp_;  // norms (and a classifier's score head)
        if (sequence_parallel_ && name.find("norm.weight") != std::string::npos) tp_partial.push_back(i);
      }
      trainable_.push_back(i);
      copies_.push_back(copies);
    }
    using weft::plugins::GradientAverager;
    if (!tp_partial.empty()) sum_over_tp_ = std::make_unique<GradientAverager>(host(), tp_group_, bucket_mb_, tp_partial);
    if (!kv_partial.empty()) sum_over_kv_ = std::make_unique<GradientAverager>(host(), kv_group_, bucket_mb_, kv_partial);
  }

  double squares(int64_t index) const { return host().squared_norm(host().parameter_grad(index)); }
  void sum_over(weft::sdk::Group group, std::vector<double>& values) const {
    values = weft::plugins::sum_over(host(), group, std::move(values));
  }
  double mean_over_replicas(double loss) const {
    std::vector<double> v{loss};
    sum_over(world_, v);
    return v[0] / world_.size();
  }

  weft::sdk::Group world_, tp_group_, kv_group_;
  int32_t tp_ = 1, dp_ = 1, tp_rank_ = 0, dp_rank_ = 0, kv_parts_ = 1;
  double bucket_mb_ = 25.0;
  bool sequence_parallel_ = false;
  std::unique_ptr<weft::plugins::GradientAverager> average_, sum_over_tp_, sum_over_kv_;
  std::vector<int64_t> trainable_;
  std::vector<double> copies_;
};

}  // namespace

WEFT_STRATEGY(TensorParallel, "tensor_parallel", "1.0.0", "Megatron tensor parallelism (x data parallel)")
