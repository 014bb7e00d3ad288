// Precompiled header for weft_core, trainer and the tests. Only stable, heavy third-party
// headers belong here; project headers must still include what they use.
#pragma once
#include <torch/torch.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <string>
#include <vector>
#include <memory>
#include <unordered_map>
