// The host services for process groups, collectives and point-to-point transfers (over core/dist).
#include "core/plugin/host_services.h"

#include "core/util/trace.h"

#include <algorithm>
#include <cstring>

namespace weft {
namespace host {


weft_group* wrap_group(State& s, ProcessGroup& group) {
  for (auto& g : s.groups) {
    if (g->group == &group) return g.get();
  }
  s.groups.push_back(std::make_unique<weft_group>(weft_group{&group}));
  return s.groups.back().get();
}

weft_group* group_world(weft_host* host) {
  try {
    auto& s = state_of(host);
    return wrap_group(s, s.communicator->world());
  } catch (...) {
    return nullptr;
  }
}
int32_t group_rank(const weft_group* group) { return group && group->group ? group->group->rank : -1; }
int32_t group_size(const weft_group* group) { return group && group->group ? group->group->size : 0; }

weft_status* group_create(weft_host* host, const int32_t* ranks, int32_t count, weft_group** out) {
  return guarded([&] {
    WEFT_CHECK(ranks && count > 0 && out, "group_create: empty rank list");
    auto& s = state_of(host);
    *out = wrap_group(s, s.communicator->create_group(std::vector<int32_t>(ranks, ranks + count)));
  });
}

weft_status* all_reduce(weft_host* host, weft_group* group, DLTensor* tensor, weft_reduce_op op, weft_work** work) {
  return guarded([&] {
    WEFT_CHECK(work, "all_reduce: null work output");
    auto& g = group_of(group);
    *work = new_work(host, communicator_of(host).all_reduce(g, contiguous_view(tensor, "all_reduce"), reduce_op(op)));
  });
}

weft_status* reduce_scatter(weft_host* host, weft_group* group, DLTensor* output, const DLTensor* input,
                            weft_reduce_op op, weft_work** work) {
  return guarded([&] {
    WEFT_CHECK(work, "reduce_scatter: null work output");
    auto& g = group_of(group);
    *work = new_work(host, communicator_of(host).reduce_scatter(g, contiguous_view(output, "reduce_scatter output"),
                                                                contiguous_view(input, "reduce_scatter input"),
                                                                reduce_op(op)));
  });
}

weft_status* all_gather(weft_host* host, weft_group* group, DLTensor* output, const DLTensor* input, weft_work** work) {
  return guarded([&] {
    WEFT_CHECK(work, "all_gather: null work output");
    auto& g = group_of(group);
    *work = new_work(host, communicator_of(host).all_gather(g, contiguous_view(output, "all_gather output"),
                                                            contiguous_view(input, "all_gather input")));
  });
}

weft_status* broadcast(weft_host* host, weft_group* group, DLTensor* tensor, int32_t root, weft_work** work) {
  return guarded([&] {
    WEFT_CHECK(work, "broadcast: null work output");
    auto& g = group_of(group);
    *work = new_work(host, communicator_of(host).broadcast(g, contiguous_view(tensor, "broadcast"), root));
  });
}

weft_status* all_to_all(weft_host* host, weft_group* group, DLTensor* output, const DLTensor* input, weft_work** work) {
  return guarded([&] {
    WEFT_CHECK(work, "all_to_all: null work output");
    auto& g = group_of(group);
    *work = new_work(host, communicator_of(host).all_to_all(g, contiguous_view(output, "all_to_all output"),
                                                            contiguous_view(input, "all_to_all input")));
  });
}

weft_status* send(weft_host* host, weft_group* group, const DLTensor* tensor, int32_t peer, int32_t tag, weft_work** work) {
  return guarded([&] {
    WEFT_CHECK(work, "send: null work output");
    auto& g = group_of(group);
    *work = new_work(host, communicator_of(host).send(g, contiguous_view(tensor, "send"), peer, tag));
  });
}

weft_status* recv(weft_host* host, weft_group* group, DLTensor* tensor, int32_t peer, int32_t tag, weft_work** work) {
  return guarded([&] {
    WEFT_CHECK(work, "recv: null work output");
    auto& g = group_of(group);
    *work = new_work(host, communicator_of(host).recv(g, contiguous_view(tensor, "recv"), peer, tag));
  });
}

weft_status* work_wait(weft_host* host, weft_work* work) {
  return guarded([&] {
    WEFT_CHECK(work != nullptr, "work_wait: null work");
    if (work->waited) return;
    const auto start = std::chrono::steady_clock::now();
    try {
      communicator_of(host).wait(work->operation);
    } catch (const CommError& e) {
      throw CodedError(e.timed_out() ? WEFT_STATUS_TIMEOUT : WEFT_STATUS_COMMUNICATION, e.what());
    }
    add_wait_time(host, start);
    if (Tracer::instance().enabled()) {
      Tracer::instance().complete("wait", "wait " + work->operation.name, start,
                                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    work->waited = true;
  });
}

void work_release(weft_host* host, weft_work* work) {
  if (!work) return;
  if (!work->waited) status_release(work_wait(host, work));
  delete work;
}

}  // namespace host
}  // namespace weft
