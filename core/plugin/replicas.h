// Replicas start equal, without copying the model over the network: the host's steps for ABI 2
// plugins (abi2.cpp, abi2_pipeline.cpp) need every data-parallel replica of a parameter to hold
// the same values before the first step. Ranks that loaded one checkpoint, or drew one seed's
// init, already do; broadcasting every parameter from rank 0 anyway cost a 135M-parameter model
// ~560 MB per rank on the inter-node link at each start and resume (~45 s at 100 Mbit/s).
#pragma once

#include <cstdint>
#include <vector>

#include "core/plugin/step/step.hpp"

namespace weft {

struct ReplicaSync {
  int64_t parameters = 0;  // compared
  int64_t differed = 0;    // broadcast from the group's rank 0
  int64_t bytes = 0;       // their size
};

// Each rank fingerprints its copy of the `parameters` (XXH64 of their bytes; CUDA ones copied to
// the host in chunks); one all-reduce (MAX of each fingerprint and of its complement: the largest
// and the smallest) finds those that differ on some rank of `group`, and only those are broadcast
// from its rank 0, as before. Every rank of the group calls it with the same list.
ReplicaSync make_replicas_equal(const sdk::Host& h, sdk::Group group, const std::vector<int64_t>& parameters);

}  // namespace weft
