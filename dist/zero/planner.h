// The planner: which parameters go in which unit, and how each unit packs them -- a pure
// function of the model's named parameters, its unit plan, the configuration and the
// number of ranks a unit shards over. Nothing is allocated or moved and no rank talks
// to another: a refused plan leaves the model as it was, and the planner is tested alone.
//
//   units        the root (everything no listed module holds), then the plan's modules;
//                a parameter goes to the innermost unit whose path prefixes its name
//   packing      per unit, each AdamW group's matrices, then its vectors: every (group,
//                decay) pair is one range the optimizer updates with one call; padded to
//                a multiple of the S ranks it shards over, rank r holding slice r
//   frozen       parameters without requires_grad get no gradient or optimizer state:
//                whole on every rank at stages 0-2 (replicated), sharded in a buffer of
//                their unit's own at stage 3 (floating ones; integer ones stay replicated)
//   tags         each unit's collectives carry its number, from 1
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "dist/zero/zero_config.h"
#include "nn/module.h"

namespace zg::dist {

// Where one parameter sits in its unit's flat buffers.
struct ParamSlot {
  std::string name;
  Tensor param;    // the module's parameter, a view into the unit's full buffer once materialized
  int64_t offset;  // in elements, into every buffer of the unit
  Shape shape;
};

// [begin, end) of a unit's trained buffer that one parameter group's matrices or vectors
// fill, with what that group changes (unset: the defaults).
struct UpdateRange {
  int64_t begin, end;
  bool decay;
  double lr_scale;
  std::optional<double> weight_decay;
};

// One unit as planned: its parameters' places in the flat buffers, and their sizes.
struct UnitSpec {
  std::string name;              // "root", or the module's path
  nn::Module* module = nullptr;  // null for the root
  int64_t tag = 0;               // its collectives' CollectiveTag: its place in the units, from 1
  std::vector<ParamSlot> entries, frozen_entries;
  std::vector<UpdateRange> update_ranges;
  int64_t numel = 0, padded = 0, shard = 0;  // the trained buffer: S = padded / shard ranks
  int64_t frozen_padded = 0;                 // the frozen buffer (stage 3), padded alike
  bool keep_after_forward = false;           // ZeRO-3: gathered from its forward to its backward
};

struct ShardingPlan {
  std::vector<UnitSpec> units;
  nn::NamedTensors replicated_frozen;  // frozen parameters every rank holds whole
  bool root_gathered = false;          // ZeRO-3: the root unit has weights to gather (it is units[0])
};

// Everything the planner reads. `aliases`: every name of every parameter
// (named_parameters(false)): a tied weight has several, each in some module.
struct PlannerInput {
  nn::NamedTensors parameters, aliases;
  std::vector<std::pair<std::string, nn::Module*>> modules;
  nn::UnitPlan plan;
  ZeroConfig config;
  int shard_ranks = 1;  // S: the ranks a unit shards over (the dp_shard dimension)
};

// The plan, or a zg::Error naming what is wrong (a module the model lacks, a unit with no
// parameters, a weight shared across ZeRO-3 units, a parameter group matching nothing, ...).
// The configuration is assumed valid (ZeroConfig::check).
ShardingPlan plan_sharding(const PlannerInput& input);

}  // namespace zg::dist
