#include "dist/zero/sharded_model.h"

#include "dist/zero/unit.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>

#include "autograd/functions.h"
#include "autograd/graph.h"
#include "optim/flat_parameters.h"
#include "optim/schedule.h"

namespace zg::dist {

namespace {

Tensor view_of(const Tensor& flat, const optim::FlatParameters::Entry& e) {
  return optim::FlatParameters::view_of(flat, e);
}

// The shortest decimal that reads back as x: values that differ show how.
std::string shortest(double x) {
  char text[32];
  return std::string(text, std::to_chars(text, text + sizeof text, x).ptr);
}

// FNV-1a, cut to 53 bits: a double holds it exactly, so an Agreement can compare it.
class Hash53 {
 public:
  void mix(const void* data, size_t bytes) {
    for (size_t i = 0; i < bytes; ++i) hash_ = (hash_ ^ static_cast<const unsigned char*>(data)[i]) * 1099511628211ull;
  }
  double value() const { return static_cast<double>(hash_ & ((uint64_t{1} << 53) - 1)); }

 private:
  uint64_t hash_ = 14695981039346656037ull;
};

void mix_name_and_shape(Hash53& hash, const std::string& name, const Shape& shape) {
  hash.mix(name.data(), name.size() + 1);  // with its terminating zero: "a" "bc" is not "ab" "c"
  const int64_t rank = static_cast<int64_t>(shape.size());
  hash.mix(&rank, sizeof rank);
  hash.mix(shape.data(), shape.size() * sizeof(int64_t));
}

// A unit's parameter names and shapes (its trained entries in packing order, then its
// frozen ones), hashed.
double layout_hash(const ShardedModel::Unit& unit) {
  Hash53 hash;
  for (const auto* entries : {&unit.entries, &unit.frozen_entries}) {
    for (const auto& e : *entries) mix_name_and_shape(hash, e.name, e.shape);
    hash.mix("", 1);  // where the trained ones end
  }
  return hash.value();
}

// The replicated tensors' names, shapes and dtypes, hashed.
double replicated_hash(const nn::NamedTensors& replicated) {
  Hash53 hash;
  for (const auto& [name, b] : replicated) {
    mix_name_and_shape(hash, name, b.shape());
    const DType dtype = b.dtype();
    hash.mix(&dtype, sizeof dtype);
  }
  return hash.value();
}

Tensor allocate(const Shape& shape, DType dtype, Device device, MemoryCategory category, bool zeroed) {
  MemoryScope scope(category);
  Tensor t = empty(shape, TensorOptions(dtype).device(device));
  if (zeroed) t.zero_();
  return t;
}

}  // namespace

Device agreement_device(const ProcessGroup& group, Device model_device) {
  const Device on = model_device.type == DeviceType::meta ? kCPU : model_device;
  return group.accepts(on) ? on : kCPU;
}

Agreement::Agreement(ProcessGroup& group, Device on, const std::vector<std::pair<std::string, double>>& values) {
  std::vector<double> bounds;
  for (const auto& [name, value] : values) {
    names_.push_back(name);
    bounds.insert(bounds.end(), {value, -value});
  }
  bounds_ = tensor<double>(bounds).to(on);
  work_ = group.all_reduce_async(bounds_, ReduceKind::max);
}

void Agreement::check(const std::string& who) {
  work_->wait();
  const std::vector<double> extremes = bounds_.to_vector<double>();
  for (size_t i = 0; i < names_.size(); ++i)
    ZG_CHECK(extremes[2 * i] == -extremes[2 * i + 1], who, " a different ", names_[i], " on some ranks (from ",
             shortest(-extremes[2 * i + 1]), " to ", shortest(extremes[2 * i]), "); every rank must pass the same");
}

void all_or_none(ProcessGroup& group, Device device, const std::string& who, const std::string& consequence,
                 const std::function<void()>& fn) {
  std::string problem;
  try {
    fn();
  } catch (const std::exception& e) {  // a std::filesystem error too
    problem = e.what();
  }
  const Tensor failures =
      full({1}, problem.empty() ? 0.0 : 1.0, TensorOptions(DType::f64).device(agreement_device(group, device)));
  group.all_reduce(failures, ReduceKind::sum);
  if (!problem.empty()) throw Error(consequence.empty() ? problem : problem + " (" + consequence + ")");
  const double failed = failures.item<double>();
  ZG_CHECK(failed == 0, who, ": ", failed, " other rank(s) failed (their errors say why)",
           consequence.empty() ? "" : "; ", consequence);
}

UnitPlan gpt_unit_plan(int64_t n_layer) {
  UnitPlan plan;
  for (int64_t i = 0; i < n_layer; ++i) plan.units.push_back("transformer.h." + std::to_string(i));
  plan.root_before = {"transformer.wte", "transformer.wpe"};
  plan.root_after = {"transformer.ln_f"};
  return plan;
}

ShardedModel::ShardedModel(nn::Module& model, const UnitPlan& plan, ProcessGroup& group, ZeroConfig config)
    : group_(group), config_(config), buffers_(model.named_buffers()) {
  const auto modules = model.named_modules();
  // The checks and the plan, on each rank alone -- then every rank learns whether any
  // failed, before the collectives below: a rank that threw here would never issue them.
  const nn::NamedTensors parameters = model.named_parameters();
  const Device device = parameters.empty() ? kCPU : parameters.front().second.device();
  all_or_none(group_, device, "ShardedModel", "", [&] { plan_units(model, parameters, plan, modules); });
  // Collective tags: each unit's number, from 1; a ZeRO unit's one bucket has its unit's,
  // DDP's buckets numbers of their own after those (two buckets of one size would pair
  // silently between ranks that reduce them in different orders).
  for (size_t u = 0; u < units_.size(); ++u) units_[u]->tag = static_cast<int64_t>(u) + 1;
  int64_t next_tag = static_cast<int64_t>(units_.size()) + 1;
  for (auto& unit : units_) {
    plan_buckets(*unit);
    for (Bucket& bucket : unit->buckets) bucket.tag = config_.stage == 0 ? next_tag++ : unit->tag;
  }
  plan_reduce_order(parameters);
  // The ranks' configs and models agree (a different weight decay or clipping norm made
  // DDP replicas drift apart without a word), and rank 0's initial weights become every
  // rank's in build_unit, as PyTorch DDP broadcasts its module states.
  {
    const ZeroConfig& c = config_;
    Agreement agree(group_, agreement_device(group_, device),
                    {{"ZeroConfig::stage", c.stage}, {"ZeroConfig::compute_dtype", static_cast<double>(c.compute_dtype)},
                     {"reduce dtype", static_cast<double>(reduce_dtype())},
                     {"ZeroConfig::bucket_bytes", static_cast<double>(c.bucket_bytes)},
                     {"ZeroConfig::prefetch", c.prefetch}, {"ZeroConfig::max_grad_norm", c.max_grad_norm},
                     {"AdamWOptions::beta1", c.adamw.beta1}, {"AdamWOptions::beta2", c.adamw.beta2},
                     {"AdamWOptions::eps", c.adamw.eps}, {"AdamWOptions::weight_decay", c.adamw.weight_decay},
                     {"number of units", static_cast<double>(units_.size())}});
    agree.check("ShardedModel: was built with");
    // Then each unit, now that the lists line up: every collective below pairs rank r's
    // unit u with the others' unit u. Ranks that split the model differently would pair
    // buffers of different sizes (which NCCL does not check); ranks that listed equal-sized
    // units in another order would train layer 1 with layer 0's gradients, without a word.
    std::vector<std::pair<std::string, double>> units;
    for (const auto& unit : units_) {
      units.emplace_back("size of unit " + unit->name, static_cast<double>(unit->numel));
      units.emplace_back("parameter names and shapes (hashed) of unit " + unit->name, layout_hash(*unit));
    }
    Hash53 order;
    for (const auto& [unit, bucket] : reduce_order_) order.mix(&bucket->tag, sizeof bucket->tag);
    units.emplace_back("order of gradient reductions (bucket tags, hashed)", order.value());
    const nn::NamedTensors replicated = this->replicated();
    units.emplace_back("number of frozen parameters and buffers", static_cast<double>(replicated.size()));
    units.emplace_back("frozen parameter and buffer names, shapes and dtypes (hashed)", replicated_hash(replicated));
    Agreement same_units(group_, agreement_device(group_, device), units);
    same_units.check("ShardedModel: was built with");
  }
  for (auto& unit : units_) build_unit(*unit);
  {
    NoGradGuard no_grad;
    for (const auto& [name, p] : frozen_)  // held in the compute dtype, as the trained weights are
      if (is_floating(p.dtype()) && p.dtype() != config_.compute_dtype) {
        Tensor data = allocate(p.shape(), config_.compute_dtype, p.device(), MemoryCategory::parameter, false);
        data.copy_(p);
        point_data(p, data);
      }
  }
  broadcast_replicated();
  for (size_t i = 0; i < uses_.size(); ++i) hook_use(i);
  if (config_.stage == 3) hook_holders(modules);
  for (auto& unit : units_)
    for (const auto* entries : {&unit->entries, &unit->frozen_entries})
      for (const auto& e : *entries) own(e.param);
}

// The config checked, the model's parameters assigned to units (each unit's entries in
// packing order), and for ZeRO-3 the plan's uses: all before any parameter moves, so a
// refused plan leaves the model as it was.
void ShardedModel::plan_units(nn::Module& model, const nn::NamedTensors& parameters, const UnitPlan& plan,
                              const std::vector<std::pair<std::string, nn::Module*>>& modules) {
  ZG_CHECK(config_.stage >= 0 && config_.stage <= 3, "ShardedModel: stage must be 0, 1, 2 or 3, got ", config_.stage);
  ZG_CHECK(is_floating(config_.compute_dtype), "ShardedModel: compute dtype must be floating, got ",
           name(config_.compute_dtype));
  ZG_CHECK(is_floating(reduce_dtype()), "ShardedModel: reduce dtype must be floating, got ", name(reduce_dtype()));
  ZG_CHECK(config_.bucket_bytes > 0, "ShardedModel: bucket_bytes must be positive, got ", config_.bucket_bytes);
  ZG_CHECK(config_.prefetch >= 0, "ShardedModel: prefetch must be >= 0, got ", config_.prefetch);
  ZG_CHECK(std::isfinite(config_.max_grad_norm) && config_.max_grad_norm >= 0,
           "ShardedModel: max_grad_norm must be >= 0 and finite (0 disables clipping), got ", config_.max_grad_norm);
  optim::check_options(config_.adamw);
  units_.push_back(std::make_unique<Unit>());
  units_[0]->name = "root";
  for (const std::string& path : plan.units) {
    for (const auto& unit : units_)
      ZG_CHECK(unit->name != path, "ShardedModel: the plan lists unit '", path, "' twice");
    auto unit = std::make_unique<Unit>();
    unit->name = path;
    for (const auto& [p, m] : modules)
      if (p == path) unit->module = m;
    ZG_CHECK(unit->module != nullptr, "ShardedModel: the model has no submodule '", path, "'");
    units_.push_back(std::move(unit));
  }
  // Each parameter goes to the innermost unit whose path prefixes its name (a unit
  // inside another takes its own parameters, whichever the plan lists first), else to
  // the root.
  const auto unit_of = [&](const std::string& name) {
    size_t owner = 0;
    for (size_t u = 1; u < units_.size(); ++u)
      if (name.starts_with(units_[u]->name + ".") && (owner == 0 || units_[u]->name.size() > units_[owner]->name.size()))
        owner = u;
    return owner;
  };
  // Frozen parameters (requires_grad false) have no gradient, master weights or Adam
  // state. At stages 0-2 every rank holds them whole (`frozen_`); at stage 3 they are
  // sharded with their unit (as FSDP does: a frozen base model is most of a fine-tuned
  // one), in a buffer of their own -- except one of an integer dtype, which no compute
  // dtype holds.
  const auto sharded_frozen = [&](const Tensor& p) { return config_.stage == 3 && is_floating(p.dtype()); };
  std::vector<std::vector<std::pair<std::string, Tensor>>> members(units_.size()), frozen_members(units_.size());
  std::vector<bool> holds_frozen(units_.size(), false);
  nn::NamedTensors trainable;
  for (const auto& [name, p] : parameters) (p.requires_grad() ? trainable : frozen_).emplace_back(name, p);
  optim::check_packable("ShardedModel", trainable);
  for (const auto& [name, p] : trainable) members[unit_of(name)].emplace_back(name, p);
  for (const auto& [name, p] : frozen_) {
    ZG_CHECK(p.device() == trainable.front().second.device(), "ShardedModel: frozen parameter '", name, "' is on ",
             p.device().str(), ", '", trainable.front().first, "' on ", trainable.front().second.device().str());
    holds_frozen[unit_of(name)] = true;
    if (sharded_frozen(p)) frozen_members[unit_of(name)].emplace_back(name, p);
  }
  std::erase_if(frozen_, [&](const auto& named) { return sharded_frozen(named.second); });
  // A weight shared by modules of two units: at stage 3 a unit's weights exist only
  // around its own uses, so the other unit's forward would find them released.
  if (config_.stage == 3) {
    std::map<const TensorImpl*, std::string> first_name;
    for (const auto& [name, p] : parameters) first_name[&p.impl()] = name;
    for (const auto& [name, p] : model.named_parameters(/*remove_duplicates=*/false)) {
      if (!p.requires_grad() && !sharded_frozen(p)) continue;  // replicated: present on every use
      const std::string& first = first_name.at(&p.impl());
      ZG_CHECK(unit_of(name) == unit_of(first), "ShardedModel: parameter '", first, "' is also registered as '", name,
               "', in another unit ('", units_[unit_of(first)]->name, "' and '", units_[unit_of(name)]->name,
               "'); at stage 3 a unit's weights exist only around its own forward, so modules that share a weight "
               "belong to one unit");
    }
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = *units_[u];
    for (bool decay : {true, false})  // matrices first: the decay span is one contiguous range
      for (const auto& [name, p] : members[u])
        if ((p.dim() >= 2) == decay) {
          unit.entries.push_back({name, p, unit.numel, p.shape()});
          unit.numel += p.numel();
          if (decay) unit.decay_numel += p.numel();
        }
    int64_t frozen_numel = 0;
    for (const auto& [name, p] : frozen_members[u]) {
      unit.frozen_entries.push_back({name, p, frozen_numel, p.shape()});
      frozen_numel += p.numel();
    }
  }
  // A unit with nothing to train or shard goes: the root when every parameter is in a
  // unit, a unit whose parameters are all frozen (stages 0-2). A unit without any
  // parameter is a plan's mistake.
  for (size_t u = units_.size(); u-- > 0;) {
    if (!units_[u]->entries.empty() || !units_[u]->frozen_entries.empty()) continue;
    ZG_CHECK(u == 0 || holds_frozen[u], "ShardedModel: unit '", units_[u]->name, "' has no parameters");
    units_.erase(units_.begin() + static_cast<std::ptrdiff_t>(u));
  }
  for (auto& unit : units_) {
    unit->padded = padded_to_ranks(unit->numel);
    unit->shard = unit->padded / group_.size();
  }
  // A root whose parameters are all replicated (frozen, of an integer dtype) has nothing to gather.
  if (config_.stage == 3) plan_uses(plan, modules, holds_frozen[0] && members[0].empty() && frozen_members[0].empty());
}

int64_t ShardedModel::padded_to_ranks(int64_t numel) const {
  return (numel + group_.size() - 1) / group_.size() * group_.size();
}

ShardedModel::~ShardedModel() = default;

std::string ShardedModel::describe() const {
  return config_.stage == 0 ? "a DDP (stage 0) ShardedModel" : "a ZeRO-" + std::to_string(config_.stage) + " ShardedModel";
}

void ShardedModel::build_unit(Unit& unit) {
  NoGradGuard no_grad;
  const int r = group_.rank();
  const int stage = config_.stage;
  const DType compute = config_.compute_dtype, master_dtype = optim::master_dtype_for(compute);
  const bool separate_master = compute != master_dtype;
  const Device device = (unit.entries.empty() ? unit.frozen_entries : unit.entries).front().param.device();
  const auto my_slice = [&](const Tensor& full) { return full.narrow(0, r * unit.shard, unit.shard); };

  // The initial weights, flat and padded with zeros, in the master dtype: rank 0's.
  const Tensor values = rank0_values(unit.entries, unit.padded, master_dtype, device, unit.tag);
  place_weights(unit.weights, unit.entries, values);
  if (!unit.frozen_entries.empty()) {  // stage 3: held in the compute dtype, as the trained weights are
    const int64_t padded = padded_to_ranks(unit.frozen_entries.back().offset + numel(unit.frozen_entries.back().shape));
    place_weights(unit.frozen, unit.frozen_entries, rank0_values(unit.frozen_entries, padded, compute, device, unit.tag));
  }

  const Tensor& master_source = stage == 0 ? values : my_slice(values);
  if (separate_master) {
    unit.master = allocate(master_source.shape(), master_dtype, device, MemoryCategory::optimizer_state, false);
    unit.master.copy_(master_source);
  } else {
    unit.master = stage == 0 ? unit.weights.full : unit.weights.shard;
  }
  unit.m = allocate(unit.master.shape(), master_dtype, device, MemoryCategory::optimizer_state, true);
  unit.v = allocate(unit.master.shape(), master_dtype, device, MemoryCategory::optimizer_state, true);

  if (stage < 2) {
    unit.grad_full = allocate({unit.padded}, compute, device, MemoryCategory::gradient, true);
    for (const auto& e : unit.entries) point_grad(e.param, view_of(unit.grad_full, e));
    unit.grad_shard = my_slice(unit.grad_full);
  } else {
    unit.grad_shard = allocate({unit.shard}, compute, device, MemoryCategory::gradient, true);
  }

  Unit* u = &unit;
  const std::weak_ptr<ParameterOwner> alive = this->alive();
  if (stage >= 2)
    for (size_t i = 0; i < unit.entries.size(); ++i)
      unit.entries[i].param.register_hook([this, u, i, alive](const Tensor&) {
        if (alive.expired()) return Tensor();
        // Its bucket's full gradient is gone (reduced and freed) in this backward: this one would be lost.
        ZG_CHECK(!u->buckets[u->bucket_of[i]].reduced, "ShardedModel: the gradient of '", u->entries[i].name,
                 "' arrived after the gradient of its unit '", u->name,
                 "' was reduced in this backward: a parameter's gradient must come from the uses of its unit "
                 "that the UnitPlan names, once per backward");
        if (!u->grad_full.defined()) allocate_grad_full(*u);
        return Tensor();
      });
  for (size_t i = 0; i < unit.entries.size(); ++i)
    unit.entries[i].param.register_post_accumulate_grad_hook([this, u, i, alive](const Tensor&) {
      if (!alive.expired()) on_grad_arrival(*u, i);
    });
  if (stage == 3)  // gathered around each use from now on
    for (ShardedWeights* w : gathered_parts(unit)) {
      w->full.storage()->set_release_note(release_note(unit));
      w->full.storage()->release();
      w->gathered_from = w->shard.storage()->version();
    }
  unit.written_by_us = unit.weights.full.storage()->version();
}

// `entries`' values packed into a buffer of `padded` elements (zeros past their end), as
// rank 0 has them: broadcast.
Tensor ShardedModel::rank0_values(const std::vector<optim::FlatParameters::Entry>& entries, int64_t padded, DType dtype,
                                  Device device, int64_t tag) {
  const Tensor values = allocate({padded}, dtype, device, MemoryCategory::workspace, true);
  for (const auto& e : entries) view_of(values, e).copy_(e.param);
  CollectiveTag scope(tag);
  group_.broadcast(values, 0);
  return values;
}

// The compute weights of `entries` from `values` (every rank's): whole (stages 0-2) or
// slice r with the whole in `communication`, to be released (stage 3); each parameter's
// data a view of the whole.
void ShardedModel::place_weights(ShardedWeights& weights, const std::vector<optim::FlatParameters::Entry>& entries,
                                 const Tensor& values) {
  const int64_t shard = values.numel() / group_.size();
  const Tensor my_slice = values.narrow(0, group_.rank() * shard, shard);
  const auto compute = [&](const Tensor& from, MemoryCategory category) {
    Tensor t = allocate(from.shape(), config_.compute_dtype, from.device(), category, false);
    t.copy_(from);
    return t;
  };
  if (config_.stage < 3) {
    weights.full = compute(values, MemoryCategory::parameter);
    weights.shard = weights.full.narrow(0, group_.rank() * shard, shard);
  } else {
    weights.shard = compute(my_slice, MemoryCategory::parameter);
    weights.full = compute(values, MemoryCategory::communication);
  }
  for (const auto& e : entries) {
    point_data(e.param, view_of(weights.full, e));
    point_grad(e.param, Tensor());
  }
}

// Stages 2, 3, before the first gradient of a unit lands: one zeroed full buffer, the
// parameters' grads views into it.
void ShardedModel::allocate_grad_full(Unit& unit) {
  unit.grad_full = allocate({unit.padded}, config_.compute_dtype, unit.grad_shard.device(), MemoryCategory::gradient, true);
  for (const auto& e : unit.entries) point_grad(e.param, view_of(unit.grad_full, e));
}

nn::NamedTensors ShardedModel::replicated() const {
  nn::NamedTensors out;
  for (const auto& [name, p] : frozen_) out.emplace_back(std::string(kFrozenKey) + name, p);
  for (const auto& [name, b] : buffers_) out.emplace_back(std::string(kBufferKey) + name, b);
  return out;
}

// Rank 0's frozen parameters and buffers become every rank's, as PyTorch DDP broadcasts
// its module states.
void ShardedModel::broadcast_replicated() {
  NoGradGuard no_grad;
  for (const auto& [key, b] : replicated()) {
    const Tensor values = b.contiguous();  // a collective takes contiguous buffers
    group_.broadcast(values, 0);
    if (!values.is_same(b)) Tensor(b).copy_(values);
  }
}

bool ShardedModel::compute_written_by_others() const {
  // Stages 0-2: with separate compute and master weights (as in step()), a write that was
  // not ours. ZeRO-3: any write to summoned weights, which are copies.
  const bool copies = config_.stage == 3;
  for (const auto& unit : units_)
    if ((copies ? summoned_ > 0 : config_.compute_dtype != unit->master.dtype()) &&
        compute_version(*unit) != unit->written_by_us)
      return true;
  return copies && written_while_summoned_;
}

void ShardedModel::mark_compute_current() {
  written_while_summoned_ = false;
  for (auto& unit : units_) {
    if (summoned_ > 0) gather_unit(*unit);  // kept whole, and now current
    unit->written_by_us = compute_version(*unit);
  }
}

void ShardedModel::zero_grad() {
  NoGradGuard no_grad;
  finish_reductions();
  for (auto& unit : units_) {
    if (config_.stage < 2) {
      unit->grad_full.zero_();
    } else {
      unit->grad_shard.zero_();
      for (const auto& e : unit->entries) point_grad(e.param, Tensor());
      unit->grad_full = Tensor();  // a backward that never completed
    }
    for (Bucket& bucket : unit->buckets) {
      bucket.arrived = 0;
      bucket.reduced = false;
    }
  }
  reduced_ = 0;
  in_backward_ = false;
  unsynced_ = false;
}

StepResult ShardedModel::step(double lr, optim::GradScaler* scaler) {
  // Refused here, before the collectives, not by the update after them.
  ZG_CHECK(std::isfinite(lr) && lr >= 0, "ShardedModel: step lr must be >= 0 and finite, got ", lr);
  NoGradGuard no_grad;
  reduce_the_rest();  // of a backward that threw before its end
  ZG_CHECK(!unsynced_, "ShardedModel: step() after a backward with gradient sync off: its gradients were never "
           "reduced across ranks; turn sync on (set_gradient_sync(true)) for the last micro-batch");
  finish_reductions();
  // Every rank must pass the same lr and loss scale (a rank-dependent schedule would make
  // the replicas drift apart unnoticed), agreed while the norm is computed.
  //   The global norm: each rank's share of the squared norm, summed on its device, then
  // across ranks. Both are read once (the step's one host wait: the scaler and StepResult
  // need the norm). The meta device has no values: a dry run counts bytes only.
  const Device device = units_.empty() ? kCPU : units_.front()->grad_shard.device();
  const bool dry_run = device.type == DeviceType::meta;
  const Device sum_on = dry_run ? kCPU : device;
  const Device reduce_on = agreement_device(group_, device);
  const bool written = compute_written_by_others();
  std::string unfrozen;  // a parameter frozen at construction that requires grad now
  for (const auto& [name, p] : frozen_)
    if (p.requires_grad()) unfrozen = name;
  for (const auto& unit : units_)
    for (const auto& e : unit->frozen_entries)
      if (e.param.requires_grad()) unfrozen = e.name;
  Agreement agree(group_, reduce_on,
                  {{"lr", lr},
                   {"loss scale", scaler ? scaler->scale_factor() : 1.0},
                   {"count of written parameters (1: one was written in place since the last step)", written},
                   {"count of unfrozen parameters (1: one frozen at construction requires grad now)",
                    !unfrozen.empty()}});
  Tensor norm_sq = zeros({1}, TensorOptions(DType::f64).device(sum_on));
  if (!dry_run)
    for (auto& unit : units_) norm_sq = norm_sq + sum_of_squares(unit->grad_shard).to(DType::f64);
  norm_sq = norm_sq.to(reduce_on);
  group_.all_reduce(norm_sq, ReduceKind::sum);
  agree.check("ShardedModel: step() was given");
  ZG_CHECK(unfrozen.empty(), "ShardedModel: step(): parameter '", unfrozen, "' was frozen when the "
           "ShardedModel was built and requires grad now; it has no place in the units, so its gradient would be neither "
           "reduced nor applied. Build the ShardedModel after unfreezing it");
  ZG_CHECK(!written, "ShardedModel: step(): ",
           config_.stage == 3 ? std::string("the full weights of summon_full_params() were written (an in-place write "
                                            "to a parameter: fill_, copy_, an init); they are copies of the shards, "
                                            "released at the scope's end, so that write is lost")
                              : "the " + std::string(name(config_.compute_dtype)) +
                                    " compute weights were written since the last step (an in-place write to a "
                                    "parameter: fill_, copy_, an init), and the step rewrites them from the " +
                                    name(optim::master_dtype_for(config_.compute_dtype)) +
                                    " master weights, so that write would be lost",
           ". Change weights through a checkpoint (save / load, or nn::save_state before wrapping)");
  // What the gradients are multiplied by before use: 1 / loss scale, and for stage 1 the
  // 1 / N its summed reduction leaves to the step (gradient_reduction.cpp) -- folded into
  // the norm and the update, so no pass over the gradients takes the average.
  const double inv_scale = (scaler ? scaler->inv_scale() : 1.0) / (config_.stage == 1 ? group_.size() : 1);
  StepResult result{std::sqrt(norm_sq.item<double>()) * inv_scale, true};
  const bool finite = std::isfinite(result.grad_norm);
  result.stepped = scaler ? scaler->update(!finite) : finite;
  if (!result.stepped) return result;

  const int64_t r = group_.rank();
  std::vector<optim::AdamWSpan> spans;
  for (auto& unit : units_) {
    const bool sharded = config_.stage >= 1;
    const int64_t base = sharded ? r * unit->shard : 0;
    const Tensor& grad = sharded ? unit->grad_shard : unit->grad_full;
    const Tensor& compute = sharded ? unit->weights.shard : unit->weights.full;
    const bool separate = config_.compute_dtype != unit->master.dtype();  // else master *is* the compute buffer
    // The decay range [0, decay) and the rest [decay, numel), cut to this rank's part.
    for (const auto& [lo, hi, decay] : {std::tuple{int64_t(0), unit->decay_numel, true},
                                        std::tuple{unit->decay_numel, unit->numel, false}}) {
      const int64_t begin = std::max(lo, base), end = std::min(hi, base + unit->master.numel());
      if (end <= begin) continue;
      auto part = [&](const Tensor& t) { return t.narrow(0, begin - base, end - begin); };
      spans.push_back({part(unit->master), part(grad), part(unit->m), part(unit->v),
                       separate ? part(compute) : Tensor(), decay});
    }
  }
  optim::adamw_update(spans, config_.adamw, lr, step_ + 1,
                      inv_scale * optim::clip_coefficient(result.grad_norm, config_.max_grad_norm));
  ++step_;
  if (config_.stage == 1 || config_.stage == 2) {  // every rank's updated slice, into everyone's compute weights
    std::vector<WorkHandle> gathers;
    for (auto& unit : units_) {
      CollectiveTag tag(unit->tag);
      gathers.push_back(group_.all_gather_async(unit->weights.shard, unit->weights.full));
    }
    for (const WorkHandle& work : gathers) work->wait();
  }
  mark_compute_current();
  return result;
}

nn::NamedTensors ShardedModel::gathered_master() {
  NoGradGuard no_grad;
  nn::NamedTensors out;
  for (auto& unit : units_) {
    Tensor full;
    if (config_.stage > 0) {
      full = all_gathered(unit->master, unit->tag, MemoryCategory::other);
    } else {  // each rank has it all
      MemoryScope scope(MemoryCategory::other);
      full = unit->master.clone();
    }
    for (const auto& e : unit->entries) out.emplace_back(e.name, view_of(full, e));
  }
  return out;
}

Tensor ShardedModel::all_gathered(const Tensor& shard, int64_t tag, MemoryCategory category) {
  const Tensor whole = allocate({shard.numel() * group_.size()}, shard.dtype(), shard.device(), category, false);
  CollectiveTag scope(tag);
  group_.all_gather(shard, whole);
  return whole;
}

int64_t ShardedModel::num_parameters() const {
  int64_t n = 0;
  for (const auto& unit : units_) n += unit->numel;
  return n;
}

}  // namespace zg::dist
