// An ABI 2 plugin that does its own maths with LibTorch: data parallel as a layout, and a step.end
// hook that takes the norm of every parameter with at::Tensor views of the host's tensors and
// reports it (metrics.jsonl plugin.param_norm). It says which LibTorch it was built against
// (WEFT_PLUGIN_TORCH_BUILD), so the host loads it.
#include <cmath>
#include <cstring>

#include <weft/plugin_torch.hpp>

namespace {

struct Instance {
  weft_host_context* context = nullptr;
  weft_parameter_count_fn count = nullptr;
  weft_parameter_fn parameter = nullptr;
  weft_report_metric_fn report = nullptr;
};

weft_status* create(const weft_host_services* host, weft_plugin_instance** out) {
  auto* self = new Instance;
  self->context = host->context;
  self->count = reinterpret_cast<weft_parameter_count_fn>(host->get_proc_address("weft_parameter_count"));
  self->parameter = reinterpret_cast<weft_parameter_fn>(host->get_proc_address("weft_parameter"));
  self->report = reinterpret_cast<weft_report_metric_fn>(host->get_proc_address("weft_report_metric"));
  *out = reinterpret_cast<weft_plugin_instance*>(self);
  return nullptr;
}

void destroy(weft_plugin_instance* instance) { delete reinterpret_cast<Instance*>(instance); }

weft_status* layout(weft_plugin_instance*, weft_layout* out) {
  out->batch_split = WEFT_SPLIT_ROWS;
  return nullptr;
}

weft_status* step_end(weft_plugin_instance* instance, const weft_hook_event*) {
  auto* self = reinterpret_cast<Instance*>(instance);
  double squares = 0.0;
  for (int64_t i = 0; i < self->count(self->context); ++i) {
    weft_parameter_desc desc{};
    desc.struct_size = sizeof desc;
    DLTensor data{};
    if (weft_status* status = self->parameter(self->context, i, &desc, &data)) return status;
    const at::Tensor tensor = weft::sdk::from_dl_view(data);
    squares += tensor.to(at::kDouble).pow(2).sum().item<double>();
  }
  self->report(self->context, "param_norm", std::sqrt(squares));
  return nullptr;
}

const weft_hook* hooks(weft_plugin_instance*, int32_t* count) {
  static const weft_hook list[] = {{"step.end", step_end}};
  *count = 1;
  return list;
}

WEFT_PLUGIN_TORCH_BUILD(torch_build)

weft_proc proc(const char* name) {
  if (std::strcmp(name, "weft_layout") == 0) return reinterpret_cast<weft_proc>(layout);
  if (std::strcmp(name, "weft_hooks") == 0) return reinterpret_cast<weft_proc>(hooks);
  if (std::strcmp(name, "weft_torch_build") == 0) return reinterpret_cast<weft_proc>(torch_build);
  return nullptr;
}

}  // namespace

extern "C" WEFT_EXPORT const weft_plugin* weft_plugin_entry(uint16_t host_abi_major, uint16_t) {
  static const weft_plugin table = {sizeof(weft_plugin), WEFT_PLUGIN_ABI_MAJOR, WEFT_PLUGIN_ABI_MINOR, "abi2_torch",
                                    "0.1.0", "LibTorch inside a plugin", 1u << WEFT_MESH_DP, create, destroy, proc};
  return host_abi_major == WEFT_PLUGIN_ABI_MAJOR ? &table : nullptr;
}
