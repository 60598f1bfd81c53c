// What checkpoints see of a unit: its name and tag, where each parameter sits in its
// flat buffers, and the buffers of the roles a checkpoint saves and loads -- the master
// weights, Adam's m and v, and ZeRO-3's frozen shard. The view is built afresh for each
// save, load or export by roles_of, the one place that reads a Unit; everything else in
// dist/zero/checkpoint/ works on views. The tensors are handles: a load writes into them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dist/zero/unit.h"

namespace zg::dist::checkpoint {

struct UnitRoles {
  std::string name;
  int64_t tag = 0;  // its collectives' CollectiveTag (a gather for an export)
  std::vector<ParamSlot> entries, frozen_entries;  // trained; ZeRO-3's frozen
  int64_t numel = 0;  // of the trained parameters, without padding
  int64_t shard = 0;  // S: the elements of each rank's slice
  Tensor master, m, v;  // [padded] (full optimizer state) or [S]
  Tensor frozen;        // ZeRO-3's slice of the frozen parameters; undefined when none
};

UnitRoles roles_of(const Unit& unit);

}  // namespace zg::dist::checkpoint
