// How a model's parameters split into units -- the groups that DDP buckets, ZeRO
// shards and ZeRO-3 gathers together -- and where its forward uses the rest. A model
// supplies its own (Module::unit_plan: a GPT names its blocks); the dist layer only
// reads it, so nothing below knows which model it shards.
#pragma once

#include <string>
#include <vector>

namespace zg::nn {

struct UnitPlan {
  // Submodules that become units, in forward order (a GPT's blocks).
  std::vector<std::string> units{};
  // Every other parameter forms the root unit. ZeRO-3 gathers it around the modules that
  // use it: `root_before` run before the units (a GPT's embeddings), `root_after` after
  // them (the final norm; a tied head follows it), kept through their backward. With
  // neither given, the root is gathered when the model's own forward begins (its forward
  // pre-hook: the model must be called through operator()) and kept until backward ends.
  std::vector<std::string> root_before{}, root_after{};
  // Modules whose backward never reads their weights (an embedding's weight gradient is
  // a scatter-add of the output gradient): ZeRO-3 need not gather them again for it.
  std::vector<std::string> backward_reads_no_weights{};
  // Units (listed in `units` too) of which another pipeline stage holds a copy: a tied
  // embedding on the first stage, the head sharing its weight on the last. Each holds the
  // tied weight alone, so both ends lay it out alike; a ShardedModel on a mesh with a pp
  // dimension sums their gradients between its first and last pp rank after the reduction
  // and counts them once in the norm.
  std::vector<std::string> tied{};
};

}  // namespace zg::nn
