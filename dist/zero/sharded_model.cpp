#include "dist/zero/sharded_model.h"

#include <algorithm>

#include "dist/zero/gather_scheduler.h"
#include "dist/zero/gradient_reducer.h"
#include "dist/zero/paged_state.h"
#include "dist/zero/unit.h"

#include "autograd/graph.h"
#include "dist/comm/agreement.h"
#include "tensor/deferred.h"

namespace zg::dist {

namespace {

// A unit's parameter names and shapes (its trained entries in packing order, then its
// frozen ones), hashed.
double layout_hash(const Unit& unit) {
  Hash53 hash;
  for (const auto* entries : {&unit.entries(), &unit.frozen_entries()}) {
    for (const auto& e : *entries) hash.mix_name_and_shape(e.name, e.shape);
    hash.mix("", 1);  // where the trained ones end
  }
  return hash.value();
}

// The parameter groups' patterns, lr scales and weight decays, hashed.
double groups_hash(const std::vector<optim::ParamGroup>& groups) {
  Hash53 hash;
  for (const optim::ParamGroup& g : groups) {
    for (const std::string& name : g.names) hash.mix(name.c_str(), name.size() + 1);
    const double values[] = {g.lr_scale, g.weight_decay.value_or(-1.0)};
    hash.mix(values, sizeof values);
  }
  return hash.value();
}

// The replicated tensors' names, shapes and dtypes, hashed.
double replicated_hash(const nn::NamedTensors& replicated) {
  Hash53 hash;
  for (const auto& [name, b] : replicated) {
    hash.mix_name_and_shape(name, b.shape());
    const DType dtype = b.dtype();
    hash.mix(&dtype, sizeof dtype);
  }
  return hash.value();
}

// [lo, hi) of a tensor's elements in row-major order, as a flat view (the tensor is
// contiguous: a parameter, or a copy made contiguous).
Tensor flat_range(const Tensor& t, int64_t begin, int64_t count) { return t.reshape({-1}).narrow(0, begin, count); }

}  // namespace

namespace {

Device device_of(nn::Module& model) {
  const nn::NamedTensors parameters = model.named_parameters();
  return parameters.empty() ? kCPU : parameters.front().second.device();
}

// The mesh a group and shard_group_size mean: dp_replicate N / S x dp_shard S. The config
// is checked first, on every rank alike: a bad S must not reach the splits.
std::unique_ptr<DeviceMesh> data_parallel_mesh(nn::Module& model, ProcessGroup& group, const ZeroConfig& config) {
  all_or_none(group, device_of(model), "ShardedModel", "", [&] { config.check(group.size()); });
  return training_mesh(group, 1, config.shard_group_size);
}

constexpr const char* kGroupDestroyed = "ShardedModel: the process group or device mesh it was built on was destroyed; "
                                        "keep them alive as long as the model";

// The mesh's group along `dim`, held as the model holds its groups; none unless `present`.
std::optional<GroupRef> group_of(const DeviceMesh& mesh, const char* dim, bool present) {
  if (!present) return std::nullopt;
  return GroupRef(mesh.group(dim), kGroupDestroyed);
}

// The units shard over dp_shard, and with context parallelism over dp_shard x cp: a cp rank's
// gradients (of its pieces of the sequences) average with the others' (a collective).
std::optional<GroupRef> shard_group_of(DeviceMesh& mesh) {
  if (mesh.size("cp") == 1 || !mesh.has("dp_shard")) return group_of(mesh, "dp_shard", mesh.has("dp_shard"));
  return GroupRef(mesh.flatten("dp_shard_cp", {"dp_shard", "cp"}), kGroupDestroyed);
}

// The ranks of one pipeline stage: the mesh's world without its pp dimension (a collective).
ProcessGroup& stage_world(DeviceMesh& mesh) {
  if (mesh.size("pp") == 1) return mesh.world();
  std::vector<std::string> dims;
  for (const MeshDim& dim : mesh.dims())
    if (dim.name != "pp") dims.push_back(dim.name);
  ZG_CHECK(mesh.dims().front().name == "pp", "ShardedModel: pp must be the outermost dimension of the mesh, not as in ",
           mesh.describe());
  ZG_CHECK(!dims.empty(), "ShardedModel: the mesh ", mesh.describe(), " has no dp_shard dimension, which the units "
           "shard over (size 1: every rank of a stage holds them whole)");
  return mesh.flatten("stage", dims);
}

}  // namespace

ShardedModel::ShardedModel(nn::Module& model, ProcessGroup& group, ZeroConfig config)
    : ShardedModel(model, model.unit_plan(), group, config) {}

ShardedModel::ShardedModel(nn::Module& model, const UnitPlan& plan, ProcessGroup& group, ZeroConfig config)
    : ShardedModel(model, plan, nullptr, data_parallel_mesh(model, group, config), config) {}

ShardedModel::ShardedModel(nn::Module& model, DeviceMesh& mesh, ZeroConfig config)
    : ShardedModel(model, model.unit_plan(), mesh, config) {}

ShardedModel::ShardedModel(nn::Module& model, const UnitPlan& plan, DeviceMesh& mesh, ZeroConfig config)
    : ShardedModel(model, plan, &mesh, nullptr, config) {}

ShardedModel::ShardedModel(nn::Module& model, const UnitPlan& plan, DeviceMesh* mesh, std::unique_ptr<DeviceMesh> own,
                           ZeroConfig config)
    : own_mesh_(std::move(own)), mesh_(own_mesh_ ? *own_mesh_ : *mesh), group_(stage_world(mesh_), kGroupDestroyed),
      shard_(shard_group_of(mesh_)),
      replicas_(group_of(mesh_, "dp_replicate", mesh_.size("dp_replicate") > 1)),
      tp_(group_of(mesh_, "tp", mesh_.size("tp") > 1)), pp_(group_of(mesh_, "pp", mesh_.size("pp") > 1)),
      config_(config),
      buffers_(model.named_buffers()) {
  build(model, plan);
}

// The checks and the plan, on each rank alone -- then every rank learns whether any
// failed, before the collectives below: a rank that threw here would never issue them.
void ShardedModel::build(nn::Module& model, const UnitPlan& plan) {
  const Device device = device_of(model);
  all_or_none(*group_, device, "ShardedModel", "", [&] {
    ShardingPlan planned;
    for (const MeshDim& dim : mesh_.dims())
      ZG_CHECK(dim.name == "dp_replicate" || dim.name == "dp_shard" || dim.name == "cp" || dim.name == "tp" || dim.name == "pp",
               "ShardedModel: the mesh's dimension '", dim.name, "' is neither data, context, tensor nor pipeline ",
               "parallel; ZeRO shards over a mesh of dp_replicate x dp_shard, with cp for a model whose sequences ",
               "parallelize_context cut, tp for one cut by parallelize_module and pp for a pipeline stage's chunks");
    ZG_CHECK(shard_.has_value(), "ShardedModel: the mesh has no dp_shard dimension, which the units shard over "
             "(size 1: every rank holds them whole)");
    ZG_CHECK(!(pp_ && config_.offload == Offload::nvme), "ShardedModel: offload nvme does not run under a pipeline ",
             "yet (the tied ends' gradient exchange reads gradient shards the file tier holds); use offload optimizer ",
             "or optimizer+params with pp");
    const int s = shard_group().size(), dp_shard = mesh_.size("dp_shard");  // s = dp_shard x cp
    ZG_CHECK(config_.shard_group_size == 0 || config_.shard_group_size == dp_shard, "ShardedModel: shard_group_size ",
             config_.shard_group_size, " differs from the mesh's dp_shard size ", dp_shard, " (leave it 0 with a mesh)");
    const int data_ranks = group_->size() / mesh_.size("tp");  // N: every rank but the tp copies
    if (s != data_ranks) config_.shard_group_size = s;
    config_.check(data_ranks);
    // hpZ's and qgZ's node: the config's, else the mesh's ranks a node over dp_shard's stride.
    ranks_per_node_ = config_.ranks_per_node
                          ? config_.ranks_per_node
                          : std::clamp(mesh_.ranks_per_node() / mesh_.stride(mesh_.size("cp") > 1 ? "cp" : "dp_shard"), 1, s);
    ZG_CHECK(!(config_.secondary_weights || config_.gradient_bits) || s % ranks_per_node_ == 0,
             "ShardedModel: a node's ", ranks_per_node_, " ranks of the shard group (the mesh's ", mesh_.describe(),
             ") do not divide its ", s, "; set ZeroConfig::ranks_per_node");
    ZG_CHECK(!config_.secondary_weights || ranks_per_node_ < s, "ShardedModel: secondary_weights (hpZ) with the ", s,
             " ranks of the shard group on one node would copy the shard each has; set ZeroConfig::ranks_per_node "
             "(or the mesh's) to a node's ranks");
    planned = plan_sharding({.parameters = model.named_parameters(),
                             .aliases = model.named_parameters(/*remove_duplicates=*/false),
                             .modules = model.named_modules(),
                             .plan = plan,
                             .config = config_,
                             .shard_ranks = s});
    make_units(model, plan, std::move(planned), device);  // (its scheduler checks the plan's module paths)
    find_tied_units(plan);
  });
  agree_on_plan(device);
  make_node_groups();
  if (tp_) {
    std::vector<std::string> data_dims;
    for (const MeshDim& dim : mesh_.dims())
      if (dim.name != "tp" && dim.name != "pp") data_dims.push_back(dim.name);
    data_ = GroupRef(mesh_.flatten("dp", data_dims), kGroupDestroyed);
    for (const auto& [name, split] : model.named_splits()) splits_.emplace(name, split);
    plan_tensor_parallel_norm();
  }
  for (auto& unit : units_) materialize(*unit);
  materialize_replicated();
  const std::weak_ptr<ParameterOwner> alive = this->alive();
  reducer_->hook(alive, [this] {
    if (gatherer_) gatherer_->on_backward_end();
  });
  if (gatherer_) gatherer_->hook(alive);
  // A floating input meets parameters in the compute dtype: cast it there, as FSDP2's
  // MixedPrecisionPolicy(cast_forward_inputs=True) does (gradients flow back through the cast).
  model.register_forward_pre_hook([alive, dtype = config_.compute_dtype](nn::Module&, const Tensor& input) {
    const bool cast = !alive.expired() && input.defined() && is_floating(input.dtype()) && input.dtype() != dtype;
    return cast ? input.to(dtype) : Tensor();
  });
  for (auto& unit : units_)
    for (const auto* entries : {&unit->entries(), &unit->frozen_entries()})
      for (const auto& e : *entries) own(e.param);
  for (const nn::NamedTensors& named : {model.named_parameters(), model.named_buffers()})
    for (const auto& [name, _] : named) state_order_.emplace(name, state_order_.size());
  gradients_used_ = gradient_mark();
}

// hpZ and qgZ: the shard group cut into nodes of S consecutive ranks, and across them (collectives).
void ShardedModel::make_node_groups() {
  if (!config_.secondary_weights && config_.gradient_bits == 0) return;
  const int s = shard_group().size();
  node_ = shard_group().split_grid(ranks_per_node_, 1);
  across_ = shard_group().split_grid(s / ranks_per_node_, ranks_per_node_);
  context_->node = GroupRef(*node_, kGroupDestroyed);
  context_->across = GroupRef(*across_, kGroupDestroyed);
}

// The planner's units, made; the schedulers that drive them.
void ShardedModel::make_units(nn::Module& model, const UnitPlan& plan, ShardingPlan planned, Device device) {
  context_ = std::make_unique<UnitContext>(UnitContext{*shard_, replicas_, config_.placement(), config_.compute_dtype,
                                                       config_.reduce(), config_.accumulate(), device,
                                                       config_.quantize_weights, config_.secondary_weights,
                                                       config_.gradient_bits, config_.gradient_block, std::nullopt,
                                                       std::nullopt, nullptr});
  context_->delayed_update = config_.delayed_update_after >= 0;
  if (placement().pages_to_file())
    context_->file_tier = std::make_shared<FileTier>(config_.offload_dir, "rank" + std::to_string(group_->rank()),
                                                     context_->host());
  frozen_ = std::move(planned.replicated_frozen);
  for (UnitSpec& spec : planned.units) units_.push_back(std::make_unique<Unit>(*context_, std::move(spec)));
  reducer_ = std::make_unique<GradientReducer>(placement(), units(), model.named_parameters(), config_.bucket_bytes,
                                               config_.reduce());
  if (placement().gathers_parameters())
    gatherer_ = std::make_unique<GatherScheduler>(plan, model, planned.root_gathered ? units_.front().get() : nullptr,
                                                  units(), *reducer_, config_.prefetch, config_.prefetch_bytes);
}

// The ranks' configs and models agree (a different weight decay or clipping norm made DDP
// replicas drift apart without a word). Then each unit, now that the lists line up: every
// collective pairs rank r's unit u with the others' unit u. Ranks that split the model
// differently would pair buffers of different sizes (which NCCL does not check); ranks
// that listed equal-sized units in another order would train layer 1 with layer 0's
// gradients, without a word.
void ShardedModel::agree_on_plan(Device device) {
  const ZeroConfig& c = config_;
  Agreement agree(*group_, agreement_device(*group_, device),
                  {{"ZeroConfig::stage", c.stage}, {"ZeroConfig::compute_dtype", c.compute_dtype},
                   {"reduce dtype", config_.reduce()}, {"accumulate dtype", config_.accumulate()},
                   {"ZeroConfig::bucket_bytes", static_cast<double>(c.bucket_bytes)},
                   {"ZeroConfig::prefetch", c.prefetch}, {"ZeroConfig::max_grad_norm", c.max_grad_norm},
                   {"ZeroConfig::offload", c.offload},
                   {"ZeroConfig::prefetch_bytes", static_cast<double>(c.prefetch_bytes)},
                   {"ZeroConfig::shard_group_size", c.shard_group_size},
                   {"ZeroConfig::quantize_weights", c.quantize_weights},
                   {"ZeroConfig::secondary_weights", c.secondary_weights},
                   {"ZeroConfig::gradient_bits", c.gradient_bits},
                   {"ZeroConfig::gradient_block", static_cast<double>(c.gradient_block)},
                   {"ranks a node (hpZ, qgZ)", ranks_per_node_},
                   {"AdamWOptions::beta1", c.adamw.beta1}, {"AdamWOptions::beta2", c.adamw.beta2},
                   {"AdamWOptions::eps", c.adamw.eps}, {"AdamWOptions::weight_decay", c.adamw.weight_decay},
                   {"AdamWOptions::groups (hashed)", groups_hash(c.adamw.groups)},
                   {"number of units", static_cast<double>(units_.size())}});
  agree.check("ShardedModel: was built with");
  std::vector<AgreedValue> units;
  for (const auto& unit : units_) {
    units.emplace_back("size of unit " + unit->name(), static_cast<double>(unit->numel()));
    units.emplace_back("parameter names and shapes (hashed) of unit " + unit->name(), layout_hash(*unit));
  }
  Hash53 kept;  // the units kept after forward: a rank that regathers one the others keep would pair other gathers
  for (const auto& unit : units_) {
    const bool kept_unit = unit->keep_after_forward();
    kept.mix(&kept_unit, sizeof kept_unit);
  }
  units.emplace_back("units kept after forward (hashed)", kept.value());
  Hash53 order;
  for (int64_t tag : reducer_->order_tags()) order.mix(&tag, sizeof tag);
  units.emplace_back("order of gradient reductions (bucket tags, hashed)", order.value());
  const nn::NamedTensors replicated = this->replicated();
  units.emplace_back("number of frozen parameters and buffers", static_cast<double>(replicated.size()));
  units.emplace_back("frozen parameter and buffer names, shapes and dtypes (hashed)", replicated_hash(replicated));
  Agreement same_units(*group_, agreement_device(*group_, device), units);
  same_units.check("ShardedModel: was built with");
}

// The plan's tied units, found by name. Ties join the two ends of a pipeline (without pp
// the one rank holds both ends: nothing to sum); a unit dropped as all frozen has nothing to sum.
void ShardedModel::find_tied_units(const UnitPlan& plan) {
  for (const std::string& name : plan.tied) {
    ZG_CHECK(std::ranges::find(plan.units, name) != plan.units.end(), "ShardedModel: the plan ties '", name,
             "', which it does not list among its units");
    const auto unit = std::ranges::find_if(units_, [&](const auto& u) { return u->name() == name; });
    if (!pp_ || unit == units_.end()) continue;
    ZG_CHECK((*unit)->entries().size() == 1, "ShardedModel: tied unit '", name, "' holds ", (*unit)->entries().size(),
             " parameters; a tied unit holds the tied weight alone, so that both ends of the pipeline lay it out alike");
    const int rank = (*pp_)->rank(), last = (*pp_)->size() - 1;
    ZG_CHECK(rank == 0 || rank == last, "ShardedModel: pp rank ", rank, " holds tied unit '", name, "'; a tie joins ",
             "the first pp rank and the last (", last, ")");
    tied_units_.push_back(static_cast<size_t>(unit - units_.begin()));
  }
}

// A deferred parameter makes exactly the slice asked for; an eager one is rank 0's,
// broadcast whole first (as PyTorch DDP broadcasts its module states).
void ShardedModel::materialize(Unit& unit) {
  NoGradGuard no_grad;
  {
    CollectiveTag tag(unit.tag());
    for (const auto* slots : {&unit.entries(), &unit.frozen_entries()})
      for (const ParamSlot& slot : *slots) {
        if (is_deferred(slot.param) || slot.param.numel() == 0) continue;
        ZG_CHECK(slot.param.is_contiguous(), "ShardedModel: parameter '", slot.name, "' is not contiguous");
        data_group().broadcast(slot.param.detach(), 0);  // the collective's thread must not touch its autograd state
      }
  }
  unit.materialize(
      [](const ParamSlot& slot, int64_t begin, const Tensor& out) {
        if (is_deferred(slot.param)) materialize_range(slot.param, begin, out);
        else Tensor(out).copy_(flat_range(slot.param, begin, out.numel()));
      },
      {.point_data = [](const Tensor& p, const Tensor& data) { point_data(p, data); },
       .point_grad = [](const Tensor& p, const Tensor& grad) { point_grad(p, grad); }});
}

// Each unit's entries, cut to this rank's shard [r S, (r + 1) S), as runs of one weight.
void ShardedModel::plan_tensor_parallel_norm() {
  const double replicated_weight = 1.0 / (*tp_)->size();
  for (const auto& unit : units_) {
    std::vector<NormRun>& runs = norm_runs_.emplace_back();
    const int64_t first = shard_group().rank() * unit->shard(), last = first + unit->shard();
    for (const ParamSlot& e : unit->entries()) {
      const int64_t begin = std::max(first, e.offset), end = std::min(last, e.offset + numel(e.shape));
      if (begin >= end) continue;
      const double weight = splits_.contains(e.name) ? 1.0 : replicated_weight;
      if (!runs.empty() && runs.back().weight == weight && runs.back().begin + runs.back().count == begin - first)
        runs.back().count += end - begin;
      else runs.push_back({begin - first, end - begin, weight});
    }
  }
}

nn::NamedTensors ShardedModel::replicated() const {
  nn::NamedTensors out;
  for (const auto& [name, p] : frozen_) out.emplace_back(std::string(kFrozenKey) + name, p);
  for (const auto& [name, b] : buffers_) out.emplace_back(std::string(kBufferKey) + name, b);
  return out;
}

// Frozen parameters held whole (in the compute dtype, as the trained weights are) and
// buffers: deferred ones made on every rank alike, eager ones rank 0's on every rank.
void ShardedModel::materialize_replicated() {
  NoGradGuard no_grad;
  for (const auto& [name, p] : frozen_) {
    const bool cast = is_floating(p.dtype()) && p.dtype() != config_.compute_dtype;
    if (!cast && !is_deferred(p)) continue;
    Tensor data;
    {
      MemoryScope scope(MemoryCategory::parameter);
      data = empty(p.shape(), TensorOptions(cast ? config_.compute_dtype : p.dtype()).device(p.device()));
    }
    if (is_deferred(p)) materialize_range(p, 0, data.reshape({-1}));
    else data.copy_(p);
    point_data(p, data);
  }
  for (const auto& [name, b] : buffers_)
    if (is_deferred(b)) {
      MemoryScope scope(MemoryCategory::other);
      const Tensor data = empty(b.shape(), TensorOptions(b.dtype()).device(b.device()));
      materialize_range(b, 0, data.reshape({-1}));
      point_data(b, data);
    }
  for (const auto& [key, b] : replicated()) {
    const Tensor values = b.contiguous();  // a collective takes contiguous buffers
    data_group().broadcast(values, 0);
    if (!values.is_same(b)) Tensor(b).copy_(values);
  }
}

ShardedModel::~ShardedModel() = default;

void ShardedModel::set_gradient_sync(bool sync) { reducer_->set_sync(sync); }
bool ShardedModel::gradient_sync() const { return reducer_->sync(); }

const Placement& ShardedModel::placement() const { return context_->placement; }

std::string ShardedModel::describe() const {
  const std::string hybrid = replica_group() == nullptr ? "" : " (hybrid: shard groups of " +
      std::to_string(shard_group().size()) + " ranks, " + std::to_string(replica_group()->size()) + " replicas)";
  const std::string cut = tp_ ? ", its layers cut across " + std::to_string((*tp_)->size()) + " tensor-parallel ranks" : "";
  const std::string once = config_.reduce_once ? ", reducing gradients once a step" : "";
  return "a " + placement().name() + hybrid + " ShardedModel" + cut + once;
}

std::vector<Unit*> ShardedModel::units() const {
  std::vector<Unit*> out;
  for (const auto& unit : units_) out.push_back(unit.get());
  return out;
}

nn::NamedTensors ShardedModel::gathered_master() {
  NoGradGuard no_grad;
  land_delayed_update();
  nn::NamedTensors out;
  for (auto& unit : units_) {
    const StateInHost resident({unit.get()}, false);  // offload nvme: this unit's, paged in
    Tensor full;
    if (placement().optimizer_sharded()) {
      full = all_gathered(unit->master(), unit->tag(), MemoryCategory::other);
    } else {  // each rank has it all
      MemoryScope scope(MemoryCategory::other);
      full = unit->master().clone();
    }
    for (const auto& e : unit->entries()) out.emplace_back(e.name, view_of(full, e));
  }
  return out;
}

Tensor ShardedModel::all_gathered(const Tensor& shard, int64_t tag, MemoryCategory category) {
  // An offloaded shard is gathered on the model's device when the group needs that (NCCL).
  ProcessGroup& group = shard_group();
  const Device on = group.accepts(shard.device()) ? shard.device() : context_->device;
  Tensor whole;
  {
    MemoryScope scope(category);
    whole = empty({shard.numel() * group.size()}, TensorOptions(shard.dtype()).device(on));
  }
  CollectiveTag scope(tag);
  group.all_gather(shard.to(on), whole);
  return whole;
}

FileTierStats ShardedModel::file_tier_stats() const {
  return context_->file_tier ? context_->file_tier->stats() : FileTierStats{};
}

int64_t ShardedModel::largest_shard() const {
  int64_t most = 0;
  for (const auto& unit : units_) most = std::max(most, unit->shard());
  return most;
}

int64_t ShardedModel::num_parameters() const {
  int64_t n = 0;
  for (const auto& unit : units_) n += unit->numel();
  return n;
}

ShardedModel::FullParameters ShardedModel::summon_full_params() {
  if (!gatherer_) return FullParameters(nullptr);
  gatherer_->summon();
  return FullParameters(this);
}

ShardedModel::FullParameters::~FullParameters() {
  if (model_ != nullptr && !alive_.expired()) model_->end_summon();
}

void ShardedModel::end_summon() {
  if (gatherer_->end_summon()) written_while_summoned_ = true;
}

}  // namespace zg::dist
