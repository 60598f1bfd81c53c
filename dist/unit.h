// ShardedModel's unit: one group of parameters and its flat buffers, one per role
// (private to dist/; see sharded_model.h for what each stage keeps).
#pragma once

#include "dist/sharded_model.h"
#include "optim/flat_parameters.h"

namespace zg::dist {

struct ShardedModel::Unit {
  std::string name;
  nn::Module* module = nullptr;  // null for the root unit
  std::vector<optim::FlatParameters::Entry> entries;
  int64_t numel = 0, decay_numel = 0, padded = 0, shard = 0;
  Tensor compute_full;   // [padded]; stage 3: `communication`, released between uses
  Tensor compute_shard;  // [shard]: slice r of compute_full, or its own storage (stage 3)
  Tensor grad_full;      // [padded]: stages 0-1 always; stages 2-3 only during the unit's backward
  Tensor grad_shard;     // [shard]: slice r of grad_full (stages 0-1) or its own storage
  Tensor master, m, v;   // [padded] (stage 0) or [shard]
  size_t arrived = 0;    // parameters whose gradient landed in this backward
  bool in_backward = false;
};

}  // namespace zg::dist
