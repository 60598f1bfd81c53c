// ShardedModel's checkpoints, told in the order they happen; the concepts are in
// dist/zero/checkpoint/. Every rank writes the slice of each unit it owns, cut at
// parameter boundaries into pieces (pieces.h), into its file of one save's folder
// (dir.h); rank 0's file also holds the frozen parameters every rank holds whole and the
// buffers. A load reads the save's manifest (manifest.h), indexes its pieces by role and
// parameter (index.h, older formats through formats.h), checks that they cover what this
// rank holds now (coverage.h), and only once every rank agrees copies them. All of it
// works on views of the units (roles.h).
#include <algorithm>
#include <filesystem>
#include <random>
#include <set>

#include "autograd/graph.h"
#include "dist/comm/agreement.h"
#include "dist/zero/checkpoint/coverage.h"
#include "dist/zero/checkpoint/dir.h"
#include "dist/zero/checkpoint/group_file_writer.h"
#include "dist/zero/checkpoint/index.h"
#include "dist/zero/checkpoint/manifest.h"
#include "dist/zero/checkpoint/model_parameters.h"
#include "dist/zero/checkpoint/pieces.h"
#include "dist/zero/checkpoint/roles.h"
#include "dist/zero/paged_state.h"
#include "dist/zero/checkpoint/slice_order.h"
#include "dist/zero/sharded_model.h"
#include "dist/zero/unit.h"
#include "dist/tensor/parallelize.h"
#include "dist/zero/writer_lock.h"
#include "optim/grad_scaler.h"
#include "tensor/context.h"

namespace zg::dist {

using checkpoint::GroupFileWriter;
using checkpoint::Part;
using checkpoint::UnitRoles;

namespace {

// What checkpoints see of the units, but those at the `skipped` indices (a later pipeline
// stage's copies of the tied units: the first stage saves them).
std::vector<UnitRoles> views(const std::vector<std::unique_ptr<Unit>>& units, const std::vector<size_t>& skipped = {}) {
  std::vector<UnitRoles> out;
  for (size_t u = 0; u < units.size(); ++u)
    if (std::find(skipped.begin(), skipped.end(), u) == skipped.end()) out.push_back(checkpoint::roles_of(*units[u]));
  return out;
}

// The save's id, on every rank's file and in its folder's name: rank 0's random draw of
// 53 bits (exact in an f64), one that names no folder there yet.
uint64_t new_save_id(ProcessGroup& group, Device device, const std::string& dir, int64_t step) {
  uint64_t draw = 0;
  if (group.rank() == 0) {
    std::random_device entropy;
    do draw = (static_cast<uint64_t>(entropy()) << 32 | entropy()) >> 11;
    while (std::filesystem::exists(dir + "/" + checkpoint_dir::save_name(step, draw)));
  }
  const Tensor id = full({1}, static_cast<double>(draw), TensorOptions(DType::f64).device(agreement_device(group, device)));
  group.broadcast(id, 0);
  return static_cast<uint64_t>(id.item<double>());
}

// Rank and size along pp, tp and the shard group -> this rank's file and the number of
// files: (p T + t) S + r of P T S.
std::pair<int, int> save_file(std::pair<int, int> pp, std::pair<int, int> tp, std::pair<int, int> shard) {
  return {(pp.first * tp.second + tp.first) * shard.second + shard.first, pp.second * tp.second * shard.second};
}

}  // namespace

void ShardedModel::save(const std::string& dir, const Metadata& extra, const optim::GradScaler* scaler, int keep) {
  NoGradGuard no_grad;
  // A file per slice: per rank, or with hybrid sharding per rank of the shard group,
  // written by the first group (the others hold the same slices); with tensor
  // parallelism, per (tp rank, shard rank), and with pipeline parallelism per stage too --
  // the file of pp rank p, tp rank t and shard rank r is (p T + t) S + r of P T S. A tied
  // unit is saved by the first stage alone; buffers by the first file.
  const int r = shard_group().rank(), tp_rank = tp_ ? (*tp_)->rank() : 0, pp_rank = pp_ ? (*pp_)->rank() : 0;
  const auto [file_rank, files] = save_file({pp_rank, pp_ ? (*pp_)->size() : 1}, {tp_rank, tp_ ? (*tp_)->size() : 1},
                                            {r, shard_group().size()});
  const bool writes = replica_group() == nullptr || replica_group()->rank() == 0;
  ProcessGroup& world = mesh_.world();  // every stage saves at once
  const Generator& gen = Context::current().generator();
  const Device device = context_->device;
  const uint64_t save_id = new_save_id(world, device, dir, step_);
  land_delayed_update();
  const std::string folder = dir + "/" + checkpoint_dir::save_name(step_, save_id);
  Metadata meta = checkpoint::manifest_metadata({.save_id = save_id, .world_size = files, .rank = file_rank,
                                                 .stage = placement().stage(), .step = step_,
                                                 .compute_dtype = config_.compute_dtype, .rng_seed = gen.seed(),
                                                 .rng_offset = gen.offset()});
  const std::string nothing = "nothing was saved, on any rank";
  all_or_none(world, device, "ShardedModel::save", nothing, [&] {
    checkpoint::check_save_request(extra, meta, keep);
    ZG_CHECK(pp_rank == 0 || buffers_.empty(), "ShardedModel::save: pipeline stage ", pp_rank, " holds buffer '",
             buffers_.empty() ? "" : buffers_.front().first, "'; a pipeline's save writes the buffers of its first "
             "stage alone, so keep buffers in the first stage's modules");
  });
  // A request refused before anything is written; then no other job saves into `dir`
  // meanwhile (this one's lock, where it holds one, is shared).
  const CheckpointWriterLock writer(world, device, dir, "ShardedModel::save");
  all_or_none(world, device, "ShardedModel::save", nothing, [&] { std::filesystem::create_directories(folder); });
  optim::write_scaler_state(scaler, meta);
  meta.insert(extra.begin(), extra.end());
  // This rank's pieces, each parameter's shape (and cut) beside them; on rank 0 the buffers too.
  std::vector<SafetensorsWriter::Layout> layout;
  nn::NamedTensors tensors;  // views of the buffers
  const auto add = [&](const std::string& key, const Tensor& t) {
    layout.push_back({key, t.dtype(), t.shape()});
    tensors.emplace_back(key, t);
  };
  const std::vector<Part> parts = checkpoint::in_checkpoint_order(
      checkpoint::parts_of(views(units_, pp_rank > 0 ? tied_units_ : std::vector<size_t>()), replicated(), r,
                           !placement().optimizer_sharded(), /*saving=*/true),
      splits_, tp_rank, /*saving=*/true);
  for (const Part& part : parts) {
    add(checkpoint::piece_name(part), part.data);
    meta["shape/" + part.parameter()] = shape_str(part.shape);
    if (part.cut.parts > 1) meta["split/" + part.parameter()] = checkpoint::cut_str(part.cut);
  }
  if (file_rank == 0)
    for (const auto& [key, t] : replicated())
      if (key.starts_with(kBufferKey)) add(key, t);
  try {
    GroupFileWriter file(world, device, "ShardedModel::save", writes,
                         checkpoint_dir::rank_file(folder, file_rank, files), layout, meta);
    std::vector<Tensor> values;
    for (const auto& [key, t] : tensors) values.push_back(t);
    // Offload nvme: each unit's state paged in while its pieces are written, one unit at a time.
    visit_by_unit(units(), values, false, [&](size_t i) { file.write(tensors[i].first, tensors[i].second); });
    file.commit("the save in " + folder + " failed and is removed; load() reads the previous one");
  } catch (...) {
    // Every rank threw here, each past its own write (the writer's agreements): the files
    // that were written go with their folder, not at the next good save (a disk that is
    // full stays full). First every rank's writer is gone -- a failed file removes its
    // temporary as it unwinds, which would race rank 0's walk of the folder.
    try {
      world.barrier();
    } catch (...) {  // the group failed too: the save's own error says more
    }
    std::error_code ignored;
    if (world.rank() == 0) std::filesystem::remove_all(folder, ignored);
    throw;
  }
  // Every rank's file is durable: one rename of `latest` makes the save current.
  all_or_none(world, device, "ShardedModel::save",
              "the save in " + folder + " is complete but not current; load() reads the previous one", [&] {
                if (world.rank() == 0) checkpoint_dir::make_current(dir, folder.substr(dir.size() + 1), keep);
              });
}

// The pipeline's stages hold every parameter of the save between them: each stage counts
// the saved parameters it holds (a tie once, at the first stage), and the counts add up to
// the save's (a collective over pp; every rank decides alike).
void ShardedModel::check_stages_cover(const checkpoint::PieceIndex& index) const {
  std::set<std::string> mine, all;
  for (const auto& [key, pieces] : index.pieces) mine.insert(key.substr(key.find('/') + 1));
  all = mine;
  for (const std::string& name : index.elsewhere)
    if (!name.starts_with(kBufferKey)) all.insert(name);
  if ((*pp_)->rank() > 0)
    for (size_t u : tied_units_) mine.erase(units_[u]->entries().front().name);
  const Tensor held = full({1}, static_cast<double>(mine.size()),
                           TensorOptions(DType::f64).device(agreement_device(**pp_, context_->device)));
  (*pp_)->all_reduce(held, ReduceKind::sum);
  ZG_CHECK(held.item<double>() == static_cast<double>(all.size()), checkpoint::kLoad, ": the save holds ", all.size(),
           " parameters, the pipeline's stages ", held.item<double>(), " of them: a checkpoint of another model");
}

std::string ShardedModel::current_save(const std::string& dir) {
  return checkpoint_dir::current_save(dir, "ShardedModel::current_save");
}

// Each rank finds and checks what it will load, every byte it will read verified; then
// all ranks agree, so that either every rank loads or none does -- a rank whose range is
// not covered, or whose file is damaged, must not leave the others loaded.
Metadata ShardedModel::load(const std::string& dir, optim::GradScaler* scaler) {
  NoGradGuard no_grad;
  const std::vector<UnitRoles> units = views(units_);
  const nn::NamedTensors replicated = this->replicated();
  checkpoint::ModelParameters model = checkpoint::model_parameters(units, replicated, splits_);
  model.pipeline_stage = pp_.has_value();
  checkpoint::Manifest manifest;
  checkpoint::PieceIndex index;
  std::vector<Part> parts;  // what this rank loads
  const Device device = context_->device;
  ProcessGroup& world = mesh_.world();  // every stage loads, or none
  all_or_none(world, device, checkpoint::kLoad, "nothing was loaded, on any rank", [&] {
    manifest = checkpoint::read_manifest(checkpoint_dir::current_save(dir, checkpoint::kLoad), world.rank(), scaler);
    index = checkpoint::index_pieces(manifest, model);
    parts = checkpoint::covered_parts(
        manifest, index,
        checkpoint::in_checkpoint_order(checkpoint::parts_of(units, replicated, shard_group().rank(),
                                                             !placement().optimizer_sharded(), /*saving=*/false),
                                        splits_, 0, /*saving=*/false));
  });
  // One save on every rank (a save made current between two ranks' reads of `latest` is another).
  Agreement(world, agreement_device(world, device), {{"save (its id and step)", manifest.identity()}})
      .check("ShardedModel::load: nothing was loaded, on any rank: ranks found");
  if (pp_) check_stages_cover(index);

  // Everything checked, everywhere: now copy each part's overlap with each piece (once no
  // gather a forward left in flight still reads the shards).
  for (auto& unit : units_) unit->finish_gathers();
  land_delayed_update();
  // Offload nvme: a unit's state paged in while its parts are read into it and its compute
  // copy refreshed (every rank visits every unit, in order: the refresh gathers), then written back.
  std::vector<Tensor> targets;
  for (const Part& part : parts) targets.push_back(part.data);
  visit_by_unit(
      this->units(), targets, true, [&](size_t i) { checkpoint::copy_pieces({parts[i]}, index); },
      [&](size_t u) { units_[u]->refresh_compute(); });
  if (manifest.holds_replicated)
    for (const auto& [key, t] : model.buffers) manifest.first().read_into(key, t);
  step_ = manifest.step;
  if (manifest.scaler) scaler->set_scale(manifest.scaler->scale, manifest.scaler->good_steps);
  Generator& gen = Context::current().generator();
  gen.manual_seed(manifest.seed);
  gen.set_offset(manifest.offset);
  mark_compute_current();
  Metadata loaded = manifest.first().metadata();
  loaded["path"] = manifest.path;
  return loaded;
}

namespace {

// A replicated tensor (frozen/<name>, buffer/<name>) in the consolidated state: by its
// own name; a floating frozen parameter in the master dtype, as the trained ones.
SafetensorsWriter::Layout consolidated_entry(const std::string& key, const Tensor& t, DType master_dtype) {
  const bool frozen = key.starts_with(kFrozenKey);
  return {key.substr((frozen ? kFrozenKey : kBufferKey).size()),
          frozen && is_floating(t.dtype()) ? master_dtype : t.dtype(), t.shape()};
}

}  // namespace

// The consolidated state: the trained parameters (master weights), the frozen ones and
// the buffers, laid out in the model's order (named_parameters(), then named_buffers()).
std::vector<SafetensorsWriter::Layout> ShardedModel::consolidated_layout() const {
  const DType master_dtype = optim::master_dtype_for(config_.compute_dtype);
  const std::vector<UnitRoles> units = views(units_);
  std::vector<SafetensorsWriter::Layout> layout;
  for (const UnitRoles& unit : units)
    for (const ParamSlot& e : unit.entries) layout.push_back({e.name, unit.master.dtype(), whole_shape(e.name, e.shape)});
  for (const auto& [key, t] : replicated()) layout.push_back(consolidated_entry(key, t, master_dtype));
  for (const UnitRoles& unit : units)
    for (const ParamSlot& e : unit.frozen_entries) layout.push_back({e.name, master_dtype, whole_shape(e.name, e.shape)});
  std::stable_sort(layout.begin(), layout.end(), [&](const auto& a, const auto& b) {
    return state_order_.at(a.name) < state_order_.at(b.name);
  });
  return layout;
}

Shape ShardedModel::whole_shape(const std::string& name, Shape shape) const {
  const auto split = splits_.find(name);
  return split == splits_.end() ? shape : checkpoint::whole_shape(shape, split->second);
}

// With tensor parallelism each cut parameter's slices are gathered over tp first: every
// tp rank sees the whole tensor, as one rank's model holds it.
void ShardedModel::for_each_consolidated(const std::function<void(const std::string&, const Tensor&)>& each) {
  const auto fn = [&](const std::string& name, const Tensor& value) {
    const auto split = splits_.find(name);
    each(name, split == splits_.end() ? value : gather_split(value, split->second, **tp_));
  };
  NoGradGuard no_grad;
  land_delayed_update();
  const DType master_dtype = optim::master_dtype_for(config_.compute_dtype);
  const std::vector<UnitRoles> units = views(units_);
  for (size_t u = 0; u < units.size(); ++u) {
    const UnitRoles& unit = units[u];
    const StateInHost resident({units_[u].get()}, false);  // offload nvme: this unit's, paged in
    // Full optimizer state: every rank has it all. Else one unit's master weights, gathered and released.
    const Tensor whole = placement().optimizer_sharded()
                             ? all_gathered(unit.master, unit.tag, MemoryCategory::communication)
                             : unit.master;
    for (const ParamSlot& e : unit.entries) fn(e.name, view_of(whole, e));
  }
  for (const auto& [key, t] : replicated()) {
    const SafetensorsWriter::Layout entry = consolidated_entry(key, t, master_dtype);
    fn(entry.name, t.to(entry.dtype));
  }
  for (const UnitRoles& unit : units) {  // stage 3's frozen parameters: each unit's gathered, then released
    if (!unit.frozen.defined()) continue;
    const Tensor whole = all_gathered(unit.frozen, unit.tag, MemoryCategory::communication);
    for (const ParamSlot& e : unit.frozen_entries) fn(e.name, view_of(whole, e).to(master_dtype));
  }
}

nn::NamedTensors ShardedModel::consolidated_state() {
  nn::NamedTensors state;
  for_each_consolidated([&](const std::string& name, const Tensor& value) {
    MemoryScope scope(MemoryCategory::other);
    state.emplace_back(name, value.clone());
  });
  std::stable_sort(state.begin(), state.end(), [&](const auto& a, const auto& b) {
    return state_order_.at(a.first) < state_order_.at(b.first);
  });
  return state;
}

// Rank 0 writes each unit's weights as they are gathered: no rank holds more than one
// unit's at a time, as FSDP's full state dict with rank0_only and offload to the CPU.
void ShardedModel::export_consolidated(const std::string& path) {
  GroupFileWriter file(*group_, context_->device, "ShardedModel::export_consolidated",
                       group_->rank() == 0, path, consolidated_layout(), {{"format", "zerograd-consolidated-1"}});
  for_each_consolidated([&](const std::string& name, const Tensor& value) { file.write(name, value); });
  file.commit(path + " was not written");
}

}  // namespace zg::dist
