// ZeRO-3: a unit's full compute weights exist only around its uses.
//
// For each use (a block, or the modules of the plan's root_before / root_after),
// in forward order u_0 ... u_{k-1}:
//   forward pre-hook   gather the unit (waiting for its prefetch, if one is in
//                      flight); prefetch the units of u_{i+1} ... u_{i+prefetch}
//   forward hook       free it -- except for the last use (the backward starts
//                      there at once) and inside a checkpoint's recompute (the
//                      backward that follows needs it)
//   output gradient    (only if the use's backward reads weights) gather it again;
//                      prefetch the units of u_{i-1} ... u_{i-prefetch}
//   input gradient     the use's backward is done: free it; if it is the unit's
//                      first use, reduce-scatter the unit's gradient now
//   end of backward    free every unit still whole (end_of_backward): one whose
//                      use's input needs no gradient, or one a backward prefetch
//                      gathered again after its use's backward had run
// Each unit is thus gathered twice per step and its gradient reduce-scattered
// once: 3 Ψ elements of traffic per step, the ZeRO paper's figure. A GPT's tied
// embedding is needed by wte's forward and the head, not by wte's backward (a
// scatter-add), so it too is gathered twice.
//   A unit with frozen parameters holds them in a second sharded buffer (no gradient
// to reduce-scatter, no master or Adam state): "gather" and "free" do both buffers,
// with 2 Ψ_frozen elements of traffic per step.
//   Under summon_full_params() every unit is gathered once and none is released until
// the scope ends (a step gathers the new weights at once): the hooks find them current.
#include "dist/zero/unit.h"

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <utility>

#include "autograd/graph.h"

namespace zg::dist {

void ShardedModel::plan_uses(const UnitPlan& plan, const std::vector<std::pair<std::string, nn::Module*>>& modules,
                             bool root_replicated) {
  const auto module_at = [&](const std::string& path) {
    for (const auto& [p, m] : modules)
      if (p == path) return m;
    fail("ShardedModel: the model has no submodule '", path, "'");
  };
  Unit* root = units_.front()->module ? nullptr : units_.front().get();
  const auto add_root_use = [&](const std::vector<std::string>& paths) {
    if (paths.empty() || (root == nullptr && root_replicated)) return;  // nothing of the root to gather
    ZG_CHECK(root != nullptr, "ShardedModel: the plan names root modules, but every parameter is in a unit");
    Use use{root, {}, false, 0};
    for (const std::string& path : paths) {
      use.modules.push_back(module_at(path));
      use.backward_reads = use.backward_reads || use.modules.back()->backward_reads_parameters();
    }
    uses_.push_back(use);
  };
  add_root_use(plan.root_before);
  for (auto& unit : units_)
    if (unit->module) uses_.push_back({unit.get(), {unit->module}, true, 0});
  add_root_use(plan.root_after);
  for (Use& use : uses_)
    use.reduces = std::none_of(uses_.data(), &use, [&](const Use& earlier) { return earlier.unit == use.unit; });
}

void ShardedModel::hook_use(size_t index) {
  const std::weak_ptr<ParameterOwner> alive = this->alive();
  for (nn::Module* module : uses_[index].modules) {
    module->register_forward_pre_hook([this, index, alive](nn::Module&, const Tensor& input) {
      if (alive.expired()) return Tensor();
      Use& use = uses_[index];
      gather_unit(*use.unit);
      if (use.ran == 0 && !backward_in_progress()) {
        prefetch_from(index, +1);
        // A call whose backward is to come, even one a checkpoint runs without grad now
        // (its recompute, in the backward, places the hook below).
        if (use.reduces) ++use.backwards_waiting;
      }
      if (use.ran > 0 || !(use.backward_reads || use.reduces) || !GradMode::is_enabled() || !input.defined() ||
          !input.requires_grad())
        return Tensor();
      // The hook goes on an alias of the input (a view: no copy), a node of its own made
      // just before the use's, so it runs when every node the use records has run and
      // their parameters' gradients have landed (the engine runs newer nodes and
      // AccumulateGrads first) -- and before the node that made the input, whose hooks
      // gather the previous use's unit: this one's weights are released and its gradient
      // reduced first. (On the input itself the hook would run after those gathers, or,
      // on a leaf, at the leaf's AccumulateGrad, possibly before a parameter's.)
      const Tensor at = input.view(input.shape());
      at.register_hook([this, index, alive](const Tensor&) {  // this use's backward is done
        if (alive.expired()) return Tensor();
        Use& use = uses_[index];
        if (use.backward_reads) release_unit(*use.unit);
        // (A call without a backward leaves it above 0: the backward's end reduces the unit.)
        if (use.reduces && use.backwards_waiting > 0 && --use.backwards_waiting == 0) reduce_after_backward(*use.unit);
        return Tensor();
      });
      return at;
    });
    module->register_forward_hook([this, index, alive](nn::Module&, const Tensor&, const Tensor& out) {
      if (alive.expired()) return Tensor();
      Use& use = uses_[index];
      if (++use.ran < use.modules.size()) return Tensor();
      use.ran = 0;
      const bool last = index + 1 == uses_.size();
      if (!last && !backward_in_progress()) release_unit(*use.unit);
      if (use.backward_reads && out.requires_grad())
        out.register_hook([this, index, alive](const Tensor&) {  // the backward reaches this use
          if (alive.expired()) return Tensor();
          gather_unit(*uses_[index].unit);
          prefetch_from(index, -1);
          return Tensor();
        });
      return Tensor();
    });
  }
}

// A check under the plan: every module that holds a unit's parameters itself must find
// the unit whole and current before its forward and, if its backward reads weights,
// when its output's gradient arrives. Under a plan that names each unit's module, it
// always does. Under one that does not -- a ModuleList as a unit, whose own forward
// never runs; a root module missing from root_before / root_after -- the module would
// read a released buffer, one a prefetch is still writing, or the weights from before a
// step: refused, naming the module and the unit.
void ShardedModel::hook_holders(const std::vector<std::pair<std::string, nn::Module*>>& modules) {
  std::map<const TensorImpl*, Unit*> unit_of;
  for (auto& unit : units_)
    for (const auto* entries : {&unit->entries, &unit->frozen_entries})
      for (const auto& e : *entries) unit_of[&e.param.impl()] = unit.get();
  const std::weak_ptr<ParameterOwner> alive = this->alive();
  for (const auto& [path, module] : modules) {
    std::set<Unit*> held;
    for (const auto& [name, p] : module->named_parameters(/*remove_duplicates=*/false))
      if (const auto it = unit_of.find(&p.impl()); name.find('.') == std::string::npos && it != unit_of.end())
        held.insert(it->second);  // (a frozen parameter of stages 0-2 is in no unit: every rank holds it whole)
    for (Unit* unit : held) {
      // Shared by the hooks: each forward hands the backward check to a new tensor hook.
      const auto check = std::make_shared<const std::function<void(const char*)>>([this, unit, alive,
                                                                                  path](const char* when) {
        if (alive.expired()) return;
        const auto parts = gathered_parts(*unit);
        const auto any = [&](const auto& test) { return std::any_of(parts.begin(), parts.end(), test); };
        const char* state = any([](const ShardedWeights* w) { return w->gathering != nullptr; })
                                ? "still being gathered (a prefetch is writing them)"
                            : any([](const ShardedWeights* w) { return w->full.storage()->is_released(); }) ? "released"
                            : !is_current(*unit) ? "from before the last step or load"
                                                 : nullptr;
        if (state)
          fail("ShardedModel: the ", when, " of ", path.empty() ? "the root module" : "'" + path + "'",
               " reads the weights of ZeRO-3 unit '", unit->name,
               "' while they are ", state, ": ", release_note(*unit));
      });
      module->register_forward_pre_hook([check](nn::Module&, const Tensor&) {
        (*check)("forward");
        return Tensor();
      });
      if (!module->backward_reads_parameters()) continue;
      module->register_forward_hook([check](nn::Module&, const Tensor&, const Tensor& out) {
        if (out.defined() && out.requires_grad())
          out.register_hook([check](const Tensor&) {
            (*check)("backward");
            return Tensor();
          });
        return Tensor();
      });
    }
  }
}

namespace {

// Whole and gathered from the shard as it is now (not from before a step or a load).
bool current(const ShardedModel::ShardedWeights& w) {
  return !w.full.storage()->is_released() && w.shard.storage()->version() == w.gathered_from;
}

}  // namespace

std::vector<ShardedModel::ShardedWeights*> gathered_parts(ShardedModel::Unit& unit) {
  std::vector<ShardedModel::ShardedWeights*> parts;
  for (ShardedModel::ShardedWeights* w : {&unit.weights, &unit.frozen})
    if (w->full.defined() && w->full.numel() > 0) parts.push_back(w);
  return parts;
}

uint64_t compute_version(ShardedModel::Unit& unit) {
  uint64_t version = 0;  // a sum of counters that only grow
  for (const ShardedModel::ShardedWeights* w : gathered_parts(unit)) version += w->full.storage()->version();
  return version;
}

bool ShardedModel::is_current(Unit& unit) {
  const auto parts = gathered_parts(unit);
  return std::all_of(parts.begin(), parts.end(), [](const ShardedWeights* w) { return current(*w); });
}

std::string ShardedModel::release_note(const Unit& unit) {
  return "the full weights of ZeRO-3 unit '" + unit.name +
         "', gathered only around the uses its UnitPlan names: a forward through them and the backward that "
         "follows (prepare_forward() gathers a root unit no module of the plan uses); not for a module missing "
         "from the plan, a unit module whose own forward never runs (a ModuleList: name its items), a second "
         "backward through a retained graph, the backward of an earlier forward when two forwards ran first "
         "(run each forward's backward before the next forward), or after the ShardedModel is gone";
}

// Prefetches the units of the next `prefetch` uses in `direction` (+1 forward,
// -1 backward; backward skips uses whose backward reads no weights).
void ShardedModel::prefetch_from(size_t use, int direction) {
  int issued = 0;
  for (size_t i = use + direction; i < uses_.size() && issued < config_.prefetch; i += direction) {
    if (direction < 0 && !uses_[i].backward_reads) continue;
    prefetch_unit(*uses_[i].unit);
    ++issued;
  }
}

void ShardedModel::prefetch_unit(Unit& unit) {
  CollectiveTag tag(unit.tag);
  for (ShardedWeights* w : gathered_parts(unit)) prefetch(*w);
}

void ShardedModel::prefetch(ShardedWeights& weights) {
  // Weights left whole across a step or a load are the old ones: gathered again.
  if (weights.gathering || current(weights)) return;
  Storage& full = *weights.full.storage();
  full.materialize();
  // Gathering the same weights as last time keeps the version the forward's saved tensors
  // recorded, so they stay valid. Once a step or a load has written the shard, it does not:
  // a backward through a graph the old weights made fails, as at the other stages, instead
  // of computing gradients with weights the forward never used.
  const uint64_t shard_version = weights.shard.storage()->version();
  const uint64_t version = full.version();
  weights.gathering = group_.all_gather_async(weights.shard, weights.full);
  if (shard_version == weights.gathered_from) full.restore_version(version);
  weights.gathered_from = shard_version;
}

void ShardedModel::gather_unit(Unit& unit) {
  prefetch_unit(unit);
  finish_gathers(unit);
}

void ShardedModel::finish_gathers(Unit& unit) {
  for (ShardedWeights* w : gathered_parts(unit))
    if (w->gathering) std::exchange(w->gathering, nullptr)->wait();
}

void ShardedModel::release_unit(Unit& unit) {
  if (config_.stage != 3 || summoned_ > 0) return;
  finish_gathers(unit);  // a gather in flight writes into the buffers: let it finish
  for (ShardedWeights* w : gathered_parts(unit)) w->full.storage()->release();
}

void ShardedModel::prepare_forward() {
  if (config_.stage != 3) return;
  finish_reductions();
  for (auto& unit : units_) release_unit(*unit);  // left whole by a forward without backward
  for (auto& unit : units_) {
    bool used = false;
    for (const Use& use : uses_) used = used || use.unit == unit.get();
    if (!used) gather_unit(*unit);  // a root with no modules in the plan: kept until reduced
  }
  for (Use& use : uses_) use.ran = use.backwards_waiting = 0;
}

ShardedModel::FullParameters ShardedModel::summon_full_params() {
  if (config_.stage != 3) return FullParameters(nullptr);
  if (summoned_ == 0) {
    NoGradGuard no_grad;
    for (auto& unit : units_) prefetch_unit(*unit);  // every gather issued, then each waited for
    for (auto& unit : units_) {
      finish_gathers(*unit);
      unit->written_by_us = compute_version(*unit);
    }
  }
  ++summoned_;
  return FullParameters(this);
}

ShardedModel::FullParameters::~FullParameters() {
  if (model_ != nullptr && !alive_.expired()) model_->end_summon();
}

void ShardedModel::end_summon() {
  if (--summoned_ > 0) return;
  for (auto& unit : units_) {
    written_while_summoned_ = written_while_summoned_ || compute_version(*unit) != unit->written_by_us;
    // (No gather is in flight: summoned units are current, and a step gathers them at once.)
    for (ShardedWeights* w : gathered_parts(*unit))
      if (!w->gathering) w->full.storage()->release();
  }
}

}  // namespace zg::dist
