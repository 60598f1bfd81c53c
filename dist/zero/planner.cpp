#include "dist/zero/planner.h"

#include <map>
#include <set>

#include "autograd/graph.h"
#include "tensor/deferred.h"

namespace zg::dist {

namespace {

int64_t padded_to(int64_t numel, int ranks) { return (numel + ranks - 1) / ranks * ranks; }

// What packing parameters into flat buffers needs of them: at least one, each floating
// and trainable, a leaf, all on one device, none already packed by another live owner,
// and no two sharing memory. (A weight registered in two modules is one parameter,
// listed once by named_parameters; two different tensors over one storage would be
// untied by packing, so they are refused.)
void check_packable(const nn::NamedTensors& parameters) {
  ZG_CHECK(!parameters.empty(), "ShardedModel: no parameters to train");
  const Device device = parameters.front().second.device();
  std::set<std::string> names;
  for (size_t i = 0; i < parameters.size(); ++i) {
    const auto& [name, p] = parameters[i];
    ZG_CHECK(p.defined(), "ShardedModel: parameter '", name, "' is undefined");
    ZG_CHECK(names.insert(name).second, "ShardedModel: two parameters are named '", name,
             "' (a checkpoint names each parameter)");
    ZG_CHECK(is_floating(p.dtype()), "ShardedModel: parameter '", name, "' is ", describe(p),
             "; only floating parameters are trained");
    ZG_CHECK(p.device() == device, "ShardedModel: parameter '", name, "' is on ", p.device().str(), ", '",
             parameters.front().first, "' on ", device.str());
    ZG_CHECK(p.is_leaf(), "ShardedModel: parameter '", name, "' is the output of ", p.grad_fn()->name(),
             ", not a leaf; a parameter is a leaf tensor (PyTorch: can't optimize a non-leaf Tensor)");
    if (const ParameterOwner* owner = ParameterOwner::of(p))
      fail("ShardedModel: parameter '", name, "' already lives in the flat buffers of ", owner->describe());
    if (p.numel() == 0 || is_deferred(p)) continue;
    const auto [first, last] = storage_range(p);
    for (size_t j = 0; j < i; ++j) {
      const auto& [other_name, other] = parameters[j];
      if (other.numel() == 0 || is_deferred(other) || other.storage() != p.storage()) continue;
      const auto [other_first, other_last] = storage_range(other);
      ZG_CHECK(last <= other_first || other_last <= first, "ShardedModel: parameters '", other_name, "' and '", name,
               "' share memory; packing would give each its own copy. A shared weight is one tensor: register "
               "that tensor in both modules, or use it in both places");
    }
  }
}

// The root, then a unit per module the plan lists, each found in the model once.
std::vector<UnitSpec> listed_units(const PlannerInput& in) {
  std::vector<UnitSpec> units(1);
  units[0].name = "root";
  for (const std::string& path : in.plan.units) {
    for (const UnitSpec& unit : units)
      ZG_CHECK(unit.name != path, "ShardedModel: the plan lists unit '", path, "' twice");
    nn::Module* module = nullptr;
    for (const auto& [p, m] : in.modules)
      if (p == path) module = m;
    ZG_CHECK(module != nullptr, "ShardedModel: the model has no submodule '", path, "'");
    units.emplace_back().name = path;
    units.back().module = module;
  }
  return units;
}

// The innermost unit whose path prefixes `name` (a unit inside another takes its own
// parameters, whichever the plan lists first), else the root.
size_t owner_of(const std::vector<UnitSpec>& units, const std::string& name) {
  size_t owner = 0;
  for (size_t u = 1; u < units.size(); ++u)
    if (name.starts_with(units[u].name + ".") && (owner == 0 || units[u].name.size() > units[owner].name.size()))
      owner = u;
  return owner;
}

// A trained parameter's AdamW group: the first that any of its names matches (a tied weight
// has several: a tied GPT's lm_head.weight is its transformer.wte.weight). A group that
// matches no trained parameter is a mistake in its patterns, said before training.
std::map<const TensorImpl*, int> parameter_groups(const PlannerInput& in, const nn::NamedTensors& trainable) {
  const std::vector<optim::ParamGroup>& groups = in.config.adamw.groups;
  std::map<const TensorImpl*, std::vector<std::string>> names_of;
  for (const auto& [name, p] : in.aliases) names_of[&p.impl()].push_back(name);
  std::map<const TensorImpl*, int> group_of;
  std::vector<bool> matched(groups.size(), false);
  for (const auto& [name, p] : trainable) {
    int group = -1;
    for (const std::string& alias : names_of.contains(&p.impl()) ? names_of.at(&p.impl()) : std::vector{name})
      if (const int g = optim::group_of(groups, alias); g >= 0 && (group < 0 || g < group)) group = g;
    group_of[&p.impl()] = group;
    if (group >= 0) matched[static_cast<size_t>(group)] = true;
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    std::string patterns;
    for (const std::string& pattern : groups[g].names) patterns += (patterns.empty() ? "'" : ", '") + pattern + "'";
    ZG_CHECK(matched[g], "ShardedModel: AdamW parameter group ", g, " (", patterns, ") matches no trained "
             "parameter's name (names look like '", trainable.front().first, "'; patterns are globs)");
  }
  return group_of;
}

// Each group's matrices, then its vectors (no group: -1, first), then the frozen ones in a
// buffer of their own; both padded to a multiple of S (of 2 S under qgZ's int4, whose
// all-to-alls pack two elements a byte: every shard even).
void pack(UnitSpec& unit, const nn::NamedTensors& trained, const nn::NamedTensors& frozen,
          const std::vector<optim::ParamGroup>& groups, const std::map<const TensorImpl*, int>& group_of, int s,
          int multiple) {
  for (int g = -1; g < static_cast<int>(groups.size()); ++g)
    for (bool decay : {true, false}) {
      const int64_t begin = unit.numel;
      for (const auto& [name, p] : trained) {
        if (group_of.at(&p.impl()) != g || (p.dim() >= 2) != decay) continue;
        unit.entries.push_back({name, p, unit.numel, p.shape()});
        unit.numel += p.numel();
      }
      if (unit.numel > begin)
        unit.update_ranges.push_back({begin, unit.numel, decay, g < 0 ? 1.0 : groups[g].lr_scale,
                                      g < 0 ? std::nullopt : groups[g].weight_decay});
    }
  int64_t frozen_numel = 0;
  for (const auto& [name, p] : frozen) {
    unit.frozen_entries.push_back({name, p, frozen_numel, p.shape()});
    frozen_numel += p.numel();
  }
  unit.padded = padded_to(unit.numel, multiple);
  unit.shard = unit.padded / s;
  unit.frozen_padded = padded_to(frozen_numel, multiple);
}

// ZeRO-3: a weight shared by modules of two units would be released by one unit's forward
// while the other's still reads it.
void check_shared_weights(const PlannerInput& in, const std::vector<UnitSpec>& units,
                          const std::function<bool(const Tensor&)>& sharded_frozen) {
  std::map<const TensorImpl*, std::string> first_name;
  for (const auto& [name, p] : in.parameters) first_name[&p.impl()] = name;
  for (const auto& [name, p] : in.aliases) {
    if (!p.requires_grad() && !sharded_frozen(p)) continue;  // replicated: present on every use
    const std::string& first = first_name.at(&p.impl());
    const size_t a = owner_of(units, first), b = owner_of(units, name);
    ZG_CHECK(a == b, "ShardedModel: parameter '", first, "' is also registered as '", name, "', in another unit ('",
             units[a].name, "' and '", units[b].name, "'); at stage 3 a unit's weights exist only around its own "
             "forward, so modules that share a weight belong to one unit");
  }
}

// ZeRO-3's kept units, by name ("*": all); a name no unit has is a mistake.
void mark_kept(std::vector<UnitSpec>& units, const std::vector<std::string>& kept) {
  for (const std::string& name : kept) {
    std::string names;
    bool found = name == "*";
    for (UnitSpec& unit : units) {
      if (name == "*" || unit.name == name) unit.keep_after_forward = found = true;
      names += (names.empty() ? "'" : ", '") + unit.name + "'";
    }
    ZG_CHECK(found, "ShardedModel: keep_after_forward names unit '", name, "', which the plan does not have (units: ",
             names, "; or \"*\" for all)");
  }
}

}  // namespace

ShardingPlan plan_sharding(const PlannerInput& in) {
  const bool gathers = in.config.placement().gathers_parameters();
  // Frozen parameters: sharded with their unit where weights are gathered per use (as FSDP:
  // a frozen base model is most of a fine-tuned one), except integer ones no compute dtype holds.
  const auto sharded_frozen = [&](const Tensor& p) { return gathers && is_floating(p.dtype()); };
  ShardingPlan out;
  std::vector<UnitSpec> units = listed_units(in);
  std::vector<nn::NamedTensors> members(units.size()), frozen_members(units.size());
  std::vector<bool> holds_replicated(units.size(), false);
  nn::NamedTensors trainable;
  for (const auto& [name, p] : in.parameters)
    if (p.requires_grad()) trainable.emplace_back(name, p);
  check_packable(trainable);
  for (const auto& [name, p] : in.parameters) {
    const size_t u = owner_of(units, name);
    if (p.requires_grad()) {
      members[u].emplace_back(name, p);
      continue;
    }
    ZG_CHECK(p.device() == trainable.front().second.device(), "ShardedModel: frozen parameter '", name, "' is on ",
             p.device().str(), ", '", trainable.front().first, "' on ", trainable.front().second.device().str());
    if (sharded_frozen(p)) {
      frozen_members[u].emplace_back(name, p);
    } else {
      holds_replicated[u] = true;
      out.replicated_frozen.emplace_back(name, p);
    }
  }
  if (gathers) check_shared_weights(in, units, sharded_frozen);
  const std::map<const TensorImpl*, int> group_of = parameter_groups(in, trainable);
  for (size_t u = 0; u < units.size(); ++u)
    pack(units[u], members[u], frozen_members[u], in.config.adamw.groups, group_of, in.shard_ranks,
         in.shard_ranks * (in.config.gradient_bits == 4 ? 2 : 1));
  // A unit with nothing to train or shard goes: the root when every parameter is in a unit,
  // a unit whose parameters are all frozen and replicated. One without parameters is a mistake.
  for (size_t u = 0; u < units.size(); ++u) {
    if (!units[u].entries.empty() || !units[u].frozen_entries.empty()) {
      out.units.push_back(std::move(units[u]));
      if (u == 0) out.root_gathered = gathers;
      continue;
    }
    ZG_CHECK(u == 0 || holds_replicated[u], "ShardedModel: unit '", units[u].name, "' has no parameters");
  }
  const bool root_named = !in.plan.root_before.empty() || !in.plan.root_after.empty();
  const bool root_replicated = holds_replicated[0] && members[0].empty() && frozen_members[0].empty();
  ZG_CHECK(!gathers || out.root_gathered || root_replicated || !root_named,
           "ShardedModel: the plan names root modules, but every parameter is in a unit");
  for (size_t u = 0; u < out.units.size(); ++u) out.units[u].tag = static_cast<int64_t>(u) + 1;
  mark_kept(out.units, in.config.keep_after_forward);
  return out;
}

}  // namespace zg::dist
