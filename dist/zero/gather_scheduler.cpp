#include "dist/zero/gather_scheduler.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include "autograd/graph.h"

namespace zg::dist {

GatherScheduler::GatherScheduler(const nn::UnitPlan& plan, nn::Module& model, Unit* root,
                                 const std::vector<Unit*>& units, GradientReducer& reducer, int prefetch,
                                 int64_t prefetch_bytes)
    : model_(model), units_(units), reducer_(reducer), prefetch_(prefetch), prefetch_bytes_(prefetch_bytes),
      no_weight_backward_(plan.backward_reads_no_weights) {
  const auto modules = model.named_modules();
  const auto module_at = [&](const std::string& path) {
    for (const auto& [p, m] : modules)
      if (p == path) return m;
    fail("ShardedModel: the model has no submodule '", path, "'");
  };
  const auto reads_weights = [&](const std::string& path) {
    return std::find(no_weight_backward_.begin(), no_weight_backward_.end(), path) == no_weight_backward_.end();
  };
  for (const std::string& path : plan.backward_reads_no_weights) module_at(path);
  const bool root_named = !plan.root_before.empty() || !plan.root_after.empty();
  const auto add_root_use = [&](const std::vector<std::string>& paths) {
    if (paths.empty() || root == nullptr) return;  // nothing of the root to gather
    Use use{root, {}, false};
    for (const std::string& path : paths) {
      use.modules.push_back(module_at(path));
      use.backward_reads = use.backward_reads || reads_weights(path);
    }
    uses_.push_back(use);
  };
  if (root != nullptr && !root_named) uses_.push_back({root, {&model}, false, false, true});
  add_root_use(plan.root_before);
  for (Unit* unit : units)
    if (unit->module()) uses_.push_back({unit, {unit->module()}, true});
  add_root_use(plan.root_after);
  for (Use& use : uses_)
    use.reduces = !use.whole_forward &&
                  std::none_of(uses_.data(), &use, [&](const Use& earlier) { return earlier.unit == use.unit; });
}

void GatherScheduler::hook(std::weak_ptr<ParameterOwner> alive) {
  for (size_t i = 0; i < uses_.size(); ++i) hook_use(i, alive);
  hook_holders(alive);
}

// A new step's first forward: what an earlier forward without backward left whole goes.
void GatherScheduler::begin_step() {
  reducer_.finish();
  for (Unit* unit : units_) release(*unit);
  for (Use& use : uses_) use.ran = use.calls_waiting = 0;
  in_backward_.clear();
  forward_open_ = true;
}

Tensor GatherScheduler::on_pre_forward(size_t index, const Tensor& input) {
  Use& use = uses_[index];
  const bool first_module = use.ran == 0 && !backward_in_progress();
  if (first_module) {
    if (!forward_open_ || (index < last_use_ && !GradMode::is_enabled())) begin_step();
    else if (index < last_use_)  // another forward of this step: its units are gathered again
      for (Unit* unit : units_) release(*unit);
    last_use_ = index;
  }
  if (use.ran == 0) use.call = std::make_shared<Call>();  // (a checkpoint's recompute is a call too)
  use.unit->gather();
  if (first_module) {
    prefetch_from(index, +1);
    // A call whose backward is to come, even one a checkpoint runs without grad now
    // (its recompute, in the backward, places the hook below).
    if (use.reduces) ++use.calls_waiting;
  }
  if (use.ran > 0 || !(use.backward_reads || use.reduces) || !GradMode::is_enabled() || !input.defined() ||
      !input.requires_grad())
    return Tensor();
  // The post-backward hook goes on an alias of the input (a view: no copy), a node of its
  // own made just before the use's, so it runs when every node the use records has run and
  // their parameters' gradients have landed -- and before the node that made the input,
  // whose hooks gather the previous use's unit: this one's is released and reduced first.
  return input.view(input.shape());
}

void GatherScheduler::on_post_forward(size_t index, const Tensor& out) {
  Use& use = uses_[index];
  if (++use.ran < use.modules.size()) return;
  use.ran = 0;
  // Kept for the backward that follows at once: the last use's, the whole forward's.
  // Without grad no backward follows, but the model's forward may read the last use's
  // unit after it (a tied head after the final norm): the next forward releases it.
  const bool kept = use.whole_forward ? GradMode::is_enabled()
                                      : index + 1 == uses_.size() || (use.unit->keep_after_forward() &&
                                                                      GradMode::is_enabled() && out.requires_grad());
  if (!kept && !backward_in_progress()) release(*use.unit);
}

void GatherScheduler::on_pre_backward(size_t index, Call& call) {
  Use& use = uses_[index];
  if (!call.in_backward) ++in_backward_[use.unit];
  call.in_backward = true;
  use.unit->gather();
  prefetch_from(index, -1);
}

void GatherScheduler::on_post_backward(size_t index, Call& call) {
  Use& use = uses_[index];
  if (call.in_backward) --in_backward_[use.unit];
  call.in_backward = false;
  if (use.backward_reads && in_backward_[use.unit] == 0) release(*use.unit);
  // (A call without a backward leaves it above 0: the backward's end reduces the unit.)
  if (use.reduces && use.calls_waiting > 0 && --use.calls_waiting == 0) reducer_.reduce_unit(*use.unit);
}

void GatherScheduler::on_backward_end() {
  for (Unit* unit : units_) release(*unit);
  in_backward_.clear();
  forward_open_ = false;
}

// The hooks only find the use's index and call its event; they do nothing once the
// ShardedModel is gone.
void GatherScheduler::hook_use(size_t index, const std::weak_ptr<ParameterOwner>& alive) {
  for (nn::Module* module : uses_[index].modules) {
    module->register_forward_pre_hook([this, index, alive](nn::Module&, const Tensor& input) {
      if (alive.expired()) return Tensor();
      const Tensor at = on_pre_forward(index, input);
      if (at.defined())
        at.register_hook([this, index, alive, call = uses_[index].call](const Tensor&) {
          if (!alive.expired()) on_post_backward(index, *call);
          return Tensor();
        });
      return at;
    });
    module->register_forward_hook([this, index, alive](nn::Module&, const Tensor&, const Tensor& out) {
      if (alive.expired()) return Tensor();
      const std::shared_ptr<Call> call = uses_[index].call;  // before on_post_forward ends the call
      on_post_forward(index, out);
      if (uses_[index].backward_reads && out.requires_grad())
        out.register_hook([this, index, alive, call](const Tensor&) {
          if (!alive.expired()) on_pre_backward(index, *call);
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
void GatherScheduler::hook_holders(const std::weak_ptr<ParameterOwner>& alive) {
  std::map<const TensorImpl*, Unit*> unit_of;
  for (Unit* unit : units_)
    for (const auto* entries : {&unit->entries(), &unit->frozen_entries()})
      for (const auto& e : *entries) unit_of[&e.param.impl()] = unit;
  for (const auto& [path, module] : model_.named_modules()) {
    std::set<Unit*> held;
    for (const auto& [name, p] : module->named_parameters(/*remove_duplicates=*/false))
      if (const auto it = unit_of.find(&p.impl()); name.find('.') == std::string::npos && it != unit_of.end())
        held.insert(it->second);  // (a replicated frozen parameter is in no unit: every rank holds it whole)
    const bool reads_in_backward =
        std::find(no_weight_backward_.begin(), no_weight_backward_.end(), path) == no_weight_backward_.end();
    for (Unit* unit : held) {
      // Shared by the hooks: each forward hands the backward check to a new tensor hook.
      // (path = path: a structured binding is not a variable C++20 lets a lambda capture; Clang refuses it.)
      const auto check = std::make_shared<const std::function<void(const char*)>>([unit, alive,
                                                                                  path = path](const char* when) {
        if (alive.expired()) return;
        const char* state = unit->state() == Unit::State::gathering ? "still being gathered (a prefetch is writing them)"
                            : unit->state() == Unit::State::sharded    ? "released"
                            : !unit->is_current()                      ? "from before the last step or load"
                                                                       : nullptr;
        if (state)
          fail("ShardedModel: the ", when, " of ", path.empty() ? "the root module" : "'" + path + "'",
               " reads the weights of ZeRO-3 unit '", unit->name(), "' while they are ", state, ": ",
               unit->release_note());
      });
      module->register_forward_pre_hook([check](nn::Module&, const Tensor&) {
        (*check)("forward");
        return Tensor();
      });
      if (!reads_in_backward) continue;
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

// Prefetches the units of the next `prefetch` uses in `direction` (+1 forward,
// -1 backward; backward skips uses whose backward reads no weights), stopping before
// their gathered weights would pass prefetch_bytes.
void GatherScheduler::prefetch_from(size_t use, int direction) {
  int issued = 0;
  int64_t bytes = 0;
  for (size_t i = use + direction; i < uses_.size() && issued < prefetch_; i += direction) {
    if (direction < 0 && !uses_[i].backward_reads) continue;
    bytes += uses_[i].unit->gathered_bytes();
    if (prefetch_bytes_ > 0 && bytes > prefetch_bytes_) return;
    uses_[i].unit->prefetch();
    ++issued;
  }
}

void GatherScheduler::release(Unit& unit) {
  if (summoned_ == 0) unit.release();
}

void GatherScheduler::summon() {
  if (summoned_++ > 0) return;
  NoGradGuard no_grad;
  for (Unit* unit : units_) unit->prefetch(/*exact=*/true);  // every gather issued (qwZ's too: as they are), then waited for
  for (Unit* unit : units_) {
    unit->finish_gathers();
    unit->mark_compute_ours();
  }
}

bool GatherScheduler::end_summon() {
  if (--summoned_ > 0) return false;
  bool written = false;
  for (Unit* unit : units_) {
    written = written || unit->compute_written_by_others();
    unit->release();  // (no gather is in flight: summoned units are current)
  }
  return written;
}

void GatherScheduler::after_step() {
  for (Unit* unit : units_) {
    if (summoned_ > 0) unit->gather();  // kept whole, and now current
    unit->mark_compute_ours();
  }
}

}  // namespace zg::dist
