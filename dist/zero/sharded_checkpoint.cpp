// Sharded checkpoints. Every rank writes the slice [r S, (r+1) S) of each unit it
// owns (for DDP: the same slice of its full buffers, so the ranks share the
// writing), cut at parameter boundaries and named
//     <role>/<parameter name>/<first element>      role: master, exp_avg, exp_avg_sq, frozen
// with each such parameter's shape in the metadata ("shape/<parameter name>"): the
// pieces are flat, and a parameter of another shape but as many elements must not load.
// Frozen parameters are pieces too: at stage 3 each rank writes its slice of each unit's
// frozen buffer (no gathers); those every rank holds whole (stages 0-2) rank 0 writes,
// each as one piece. Rank 0's file also holds the buffers, whole, as buffer/<name>.
// Loading at another world size or stage only needs, for each parameter, the pieces
// that overlap the range a rank holds now -- found from the file headers -- and the
// buffers from the first file. load() also takes the one file optim::save_checkpoint
// wrote before training went through ShardedModel: each of its tensors is one piece.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string_view>
#include <tuple>

#include "autograd/graph.h"
#include "dist/comm/agreement.h"
#include "dist/zero/checkpoint_dir.h"
#include "dist/zero/sharded_model.h"
#include "dist/zero/unit.h"
#include "optim/grad_scaler.h"
#include "tensor/context.h"

namespace zg::dist {

using checkpoint_dir::rank_file;

namespace {

// Format 4 saves frozen parameters as pieces. Older files still load: format 3, whose
// first file holds the frozen parameters whole (as frozen/<name>); format 2, without
// frozen parameters or buffers (those are left as they are); format 1, without parameter
// shapes too (its pieces are checked by element counts only).
constexpr const char* kFormats[] = {"zerograd-sharded-checkpoint-1", "zerograd-sharded-checkpoint-2",
                                    "zerograd-sharded-checkpoint-3", "zerograd-sharded-checkpoint-4"};
constexpr int kFormatVersion = 4;

// optim::save_checkpoint's single file: whole tensors named <parameter> (master weights),
// optimizer.exp_avg.<parameter> and optimizer.exp_avg_sq.<parameter>; no frozen
// parameters or buffers. format_of() gives it 0, below every sharded format.
constexpr const char* kSingleFileFormat = "zerograd-training-checkpoint-1";

// The role and parameter of a tensor of the single file.
std::pair<std::string, std::string> single_file_name(const std::string& tensor) {
  for (const std::string role : {"exp_avg", "exp_avg_sq"})
    if (const std::string prefix = "optimizer." + role + "."; tensor.starts_with(prefix))
      return {role, tensor.substr(prefix.size())};
  return {"master", tensor};
}

// A file's format version (1 to 4), or 0 for none of them.
int format_of(const Metadata& meta) {
  const auto it = meta.find("format");
  for (int version = 1; version <= kFormatVersion; ++version)
    if (it != meta.end() && it->second == kFormats[version - 1]) return version;
  return 0;
}

// A unit range [begin, end) and where unit element `local_base` sits in the local buffers.
struct Owned {
  int64_t begin, end, local_base;
};
// What a rank writes: its slice r (with full optimizer state -- DDP -- slice r of its full
// buffers, so ranks share the work).
Owned saved_range(const Unit& unit, int rank, bool full_state) {
  const int64_t begin = rank * unit.shard(), end = std::min(begin + unit.shard(), unit.numel());
  return {begin, std::max(begin, end), full_state ? 0 : begin};
}
// What a rank must read: everything where the optimizer state is full, else its slice.
Owned loaded_range(const Unit& unit, int rank, bool full_state) {
  if (full_state) return {0, unit.numel(), 0};
  return saved_range(unit, rank, full_state);
}

// A range of one parameter's role that a rank saves or loads: elements [begin, begin +
// data.numel()) of the flattened parameter, in `data`, a 1-D view of the rank's buffer.
struct Part {
  std::string key;  // "<role>/<parameter name>"
  Shape shape;      // the parameter's
  int64_t begin;
  Tensor data;
  Tensor whole;  // a frozen parameter held whole that is not contiguous: `data` is a copy, written back after a load
};

// A saved piece: elements [begin, begin + length) of the flattened parameter.
struct Piece {
  const SafetensorsFile* file;
  std::string tensor;
  int64_t begin, length;
};

// Calls fn(key, role buffer, entry, [a, b)) for every role of every parameter that overlaps
// `own`, with [a, b) the overlap in unit elements and key "role/parameter name".
template <class Fn>
void for_each_part(const Unit& unit, const Owned& own, Fn fn) {
  const std::pair<const char*, const Tensor*> roles[] = {
      {"master", &unit.master()}, {"exp_avg", &unit.exp_avg()}, {"exp_avg_sq", &unit.exp_avg_sq()}};
  for (const auto& e : unit.entries()) {
    const int64_t a = std::max(own.begin, e.offset), b = std::min(own.end, e.offset + numel(e.shape));
    if (b <= a) continue;
    for (const auto& [role, buffer] : roles) fn(std::string(role) + "/" + e.name, *buffer, e, a, b);
  }
}

// What a rank saves (`saving`) or loads of the units: the range it owns (saved_range or
// loaded_range) of every trained parameter's master weights and Adam state and, at
// ZeRO-3, its slice of each unit's frozen buffer; of the frozen parameters held whole
// on every rank (`replicated`), all of each -- rank 0 saves them, every rank loads them.
std::vector<Part> parts_of(const std::vector<std::unique_ptr<Unit>>& units, const nn::NamedTensors& replicated,
                           int r, bool full_state, bool saving) {
  std::vector<Part> parts;
  for (const auto& unit : units) {
    const Owned own = saving ? saved_range(*unit, r, full_state) : loaded_range(*unit, r, full_state);
    for_each_part(*unit, own, [&](const std::string& key, const Tensor& buffer, const auto& e, int64_t a, int64_t b) {
      parts.push_back({key, e.shape, a - e.offset, buffer.narrow(0, a - own.local_base, b - a), {}});
    });
    const Tensor& frozen = unit->frozen_shard();
    if (!frozen.defined()) continue;
    const int64_t begin = r * frozen.numel(), end = begin + frozen.numel();
    for (const auto& e : unit->frozen_entries()) {
      const int64_t a = std::max(begin, e.offset), b = std::min(end, e.offset + numel(e.shape));
      if (a < b)
        parts.push_back({std::string(kFrozenKey) + e.name, e.shape, a - e.offset, frozen.narrow(0, a - begin, b - a), {}});
    }
  }
  if (saving && r != 0) return parts;
  for (const auto& [key, t] : replicated)
    if (key.starts_with(kFrozenKey))
      parts.push_back({key, t.shape(), 0, t.reshape({-1}), t.is_contiguous() ? Tensor() : t});
  return parts;
}

// A safetensors file that some ranks write while every rank takes part in the
// collectives that feed it (gathers, a unit at a time). It is opened on every rank that
// writes one, or on none (all_or_none). A write that fails is kept, not thrown, so its
// rank goes on through the gathers the others wait in; commit() raises it on every rank
// (the others' error says a rank failed), or commits every rank's file.
class GroupFileWriter {
 public:
  GroupFileWriter(ProcessGroup& group, Device device, std::string who, bool writes_here, const std::string& path,
                  const std::vector<SafetensorsWriter::Layout>& layout, const Metadata& meta)
      : group_(group), device_(device), who_(std::move(who)) {
    all_or_none(group_, device_, who_, path + " was not written", [&] {
      if (writes_here) file_.emplace(path, layout, meta);
    });
  }
  void write(const std::string& name, const Tensor& value) {
    if (!file_ || failed_) return;
    try {
      file_->write(name, value);
    } catch (...) {
      failed_ = std::current_exception();
    }
  }
  void commit(const std::string& consequence) {
    all_or_none(group_, device_, who_, consequence, [&] {
      if (failed_) std::rethrow_exception(failed_);
      if (file_) file_->commit();
    });
  }

 private:
  ProcessGroup& group_;
  Device device_;
  std::string who_;
  std::optional<SafetensorsWriter> file_;
  std::exception_ptr failed_;
};

}  // namespace

void ShardedModel::save(const std::string& dir, const Metadata& extra, const optim::GradScaler* scaler, int keep) {
  NoGradGuard no_grad;
  // A file per slice: per rank, or with hybrid sharding per rank of the shard group,
  // written by the first group (the others hold the same slices).
  const int r = shard_group().rank();
  const bool writes = replica_group() == nullptr || replica_group()->rank() == 0;
  const Generator& gen = Context::current().generator();
  const Device device = context_->device;
  // The save's id, on every rank's file and in its folder's name: rank 0's random draw of
  // 53 bits (exact in an f64), one that names no folder there yet.
  uint64_t draw = 0;
  if (group_.rank() == 0) {
    std::random_device entropy;
    do draw = (static_cast<uint64_t>(entropy()) << 32 | entropy()) >> 11;
    while (std::filesystem::exists(dir + "/" + checkpoint_dir::save_name(step_, draw)));
  }
  const Tensor id = full({1}, static_cast<double>(draw), TensorOptions(DType::f64).device(agreement_device(group_, device)));
  group_.broadcast(id, 0);
  const uint64_t save_id = static_cast<uint64_t>(id.item<double>());
  const std::string folder = dir + "/" + checkpoint_dir::save_name(step_, save_id);
  Metadata meta = {{"format", kFormats[kFormatVersion - 1]},
                   {"save_id", std::to_string(save_id)},
                   {"world_size", std::to_string(shard_group().size())},
                   {"rank", std::to_string(r)},
                   {"stage", std::to_string(placement().stage())},
                   {"step", std::to_string(step_)},
                   {"compute_dtype", name(config_.compute_dtype)},
                   {"rng_seed", std::to_string(gen.seed())},
                   {"rng_offset", std::to_string(gen.offset())}};
  all_or_none(group_, device, "ShardedModel::save", "nothing was saved, on any rank", [&] {
    ZG_CHECK(keep >= 1, "ShardedModel::save: keep = ", keep, " would keep no save; it must be at least 1");
    // The checkpoint's own keys would overwrite the caller's values ("path" is what load()
    // adds). shape/<parameter> keys are refused whole: a rank writes only those of the
    // parameters it owns, and every rank must refuse alike; the scaler's, with or without
    // a scaler, for the same reason.
    for (const auto& [key, value] : extra)
      ZG_CHECK(!key.starts_with("shape/") && !key.starts_with("loss_scale") && !meta.contains(key) && key != "path",
               "ShardedModel::save: the metadata key '", key, "' is one the checkpoint writes itself; name it otherwise");
    std::filesystem::create_directories(folder);
  });
  optim::write_scaler_state(scaler, meta);
  meta.insert(extra.begin(), extra.end());
  // This rank's pieces; on rank 0 the buffers too.
  std::vector<SafetensorsWriter::Layout> layout;
  nn::NamedTensors tensors;  // views of the buffers
  const auto add = [&](const std::string& key, const Tensor& t) {
    layout.push_back({key, t.dtype(), t.shape()});
    tensors.emplace_back(key, t);
  };
  for (const Part& part : parts_of(units_, replicated(), r, !placement().optimizer_sharded(), /*saving=*/true)) {
    add(part.key + "/" + std::to_string(part.begin), part.data);
    meta["shape/" + part.key.substr(part.key.find('/') + 1)] = shape_str(part.shape);
  }
  if (r == 0)
    for (const auto& [key, t] : replicated())
      if (key.starts_with(kBufferKey)) add(key, t);
  GroupFileWriter file(group_, device, "ShardedModel::save", writes, rank_file(folder, r, shard_group().size()), layout,
                       meta);
  for (const auto& [key, t] : tensors) file.write(key, t);
  file.commit("the save in " + folder + " is incomplete; load() reads the previous one");
  // Every rank's file is durable: one rename of `latest` makes the save current.
  all_or_none(group_, device, "ShardedModel::save",
              "the save in " + folder + " is complete but not current; load() reads the previous one", [&] {
                if (group_.rank() == 0) checkpoint_dir::make_current(dir, folder.substr(dir.size() + 1), keep);
              });
}

std::string ShardedModel::current_save(const std::string& dir) {
  return checkpoint_dir::current_save(dir, "ShardedModel::current_save");
}

namespace {

// What a load will do, found and checked before anything changes: every file's
// metadata, every piece's name, shape and range, that the pieces of a parameter
// neither overlap nor reach past its end, that nothing in the files is unknown to the
// model, and that each part this rank loads is covered by pieces it can read.
struct LoadPlan {
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  int format = 0;
  std::map<std::string, std::vector<Piece>> pieces;  // key: role/parameter, sorted by begin
  std::vector<Part> parts;                           // what this rank loads
  int64_t step = 0;
  uint64_t seed = 0, offset = 0;
  std::optional<optim::ScalerState> scaler;
};

// The model as a load checks the files against it: its parameters by name, with their
// shapes and the dtype they are held in (the master dtype for the trained ones).
struct ModelParameters {
  struct Held {
    Shape shape;
    DType dtype;
  };
  std::map<std::string, Held> trained, frozen;
};

LoadPlan plan_load(const std::string& dir, const ModelParameters& model, const std::vector<Part>& parts,
                   const nn::NamedTensors& buffers, int r, const optim::GradScaler* scaler) {
  constexpr const char* who = "ShardedModel::load";
  LoadPlan plan;
  // The files of one save: rank-R-of-N for every R < N; or optim::save_checkpoint's one file.
  const bool single_file = std::filesystem::is_regular_file(dir);
  int old_size = single_file ? 1 : -1;
  if (!single_file) {
    for (const auto& [path, n] : checkpoint_dir::rank_files_in(dir, who)) {
      ZG_CHECK(old_size < 0 || old_size == n, who, ": ", dir, " mixes saves of ", old_size, " and ", n, " ranks");
      old_size = n;
    }
  }
  ZG_CHECK(old_size > 0, who, ": ", dir, " has no rank-R-of-N.safetensors files");
  for (int q = 0; q < old_size; ++q) {
    const std::string path = single_file ? dir : rank_file(dir, q, old_size);
    ZG_CHECK(std::filesystem::is_regular_file(path), who, ": ", path, " is missing (a save of ", old_size, " ranks)");
    plan.files.push_back(std::make_unique<SafetensorsFile>(path));
    const Metadata& meta = plan.files.back()->metadata();
    if (single_file) {
      const auto format = meta.find("format");
      ZG_CHECK(format != meta.end() && format->second == kSingleFileFormat, who, ": ", path,
               " is a file, not a checkpoint directory; the one file load() takes is an optim::save_checkpoint "
               "training checkpoint (format ", kSingleFileFormat, "), and this is not one");
    } else {
      ZG_CHECK(format_of(meta) > 0, who, ": ", path, " is not a zerograd sharded checkpoint");
      ZG_CHECK(format_of(meta) == format_of(plan.files.front()->metadata()), who, ": ", path, " has format ",
               meta.at("format"), ", ", plan.files.front()->path(), " has ",
               plan.files.front()->metadata().at("format"), ": the files come from different saves");
      ZG_CHECK(metadata_number<int64_t>(meta, "world_size", path, who) == old_size &&
                   metadata_number<int64_t>(meta, "rank", path, who) == q,
               who, ": ", path, " says it is rank ", meta.at("rank"), " of ", meta.at("world_size"));
    }
    const int64_t step = metadata_number<int64_t>(meta, "step", path, who);
    ZG_CHECK(step >= 0 && step < INT64_MAX, who, ": ", path, ": metadata 'step' = ", step,
             " is not a count of updates that can go on");
    ZG_CHECK(q == 0 || step == plan.step, who, ": ", path, " was saved at step ", step, ", ",
             plan.files.front()->path(), " at step ", plan.step, ": the files come from different saves");
    plan.step = step;
    // One save's files share its id and loss scale (older files have neither).
    for (const char* key : {"save_id", "loss_scale", "loss_scale_good_steps"}) {
      const auto value = [&](const SafetensorsFile& f) {
        const auto it = f.metadata().find(key);
        return it == f.metadata().end() ? std::string("(none)") : it->second;
      };
      ZG_CHECK(value(*plan.files.back()) == value(*plan.files.front()), who, ": ", path, " has ", key, " ",
               value(*plan.files.back()), ", ", plan.files.front()->path(), " has ", value(*plan.files.front()),
               ": the files come from different saves");
    }
    // Every rank checks every file's generator state: all ranks accept the same files.
    metadata_number<uint64_t>(meta, "rng_seed", path, who);
    metadata_number<uint64_t>(meta, "rng_offset", path, who);
  }
  const SafetensorsFile& mine = *plan.files[std::min(r, old_size - 1)];
  plan.seed = metadata_number<uint64_t>(mine.metadata(), "rng_seed", mine.path(), who);
  plan.offset = metadata_number<uint64_t>(mine.metadata(), "rng_offset", mine.path(), who);
  plan.scaler = optim::read_scaler_state(plan.files.front()->metadata(), scaler, plan.files.front()->path(), who);
  const SafetensorsFile& first_file = *plan.files.front();
  plan.format = format_of(first_file.metadata());

  // The buffers, whole in the first file (from format 3 on): each of the model's, and no other.
  std::set<std::string> buffer_keys;
  for (const auto& [key, t] : buffers) {
    buffer_keys.insert(key);
    if (plan.format < 3) continue;
    ZG_CHECK(first_file.contains(key), who, ": ", first_file.path(), " has no '", key, "', which the model has");
    first_file.check_readable_into(key, t);
  }
  // Every other tensor is a piece of a parameter's role, indexed by role and parameter:
  // of the dtype it is held in, or floating as it is.
  for (const auto& file : plan.files)
    for (const std::string& tensor : file->names()) {
      const SafetensorsFile::Entry& entry = file->entry(tensor);
      const auto check_dtype = [&](DType held, const char* kind) {
        ZG_CHECK(entry.dtype == held || (is_floating(entry.dtype) && is_floating(held)), who, ": ", file->path(),
                 ": tensor '", tensor, "' is ", name(entry.dtype), shape_str(entry.shape), ", expected a ", kind,
                 is_floating(held) ? "floating" : name(held), " piece");
      };
      // Held whole in the first file: the buffers; in format 3, the frozen parameters too.
      const bool frozen_whole = plan.format == 3 && tensor.starts_with(kFrozenKey);
      if (tensor.starts_with(kBufferKey) || frozen_whole) {
        ZG_CHECK(file.get() == &first_file && plan.format >= 3, who, ": ", file->path(), " holds '", tensor,
                 "', but only the first file of a save holds buffers (and, in format 3, frozen parameters)");
        const std::string name = tensor.substr(frozen_whole ? kFrozenKey.size() : kBufferKey.size());
        const auto known = model.frozen.find(name);
        ZG_CHECK(frozen_whole ? known != model.frozen.end() : buffer_keys.contains(tensor), who, ": ", file->path(),
                 " holds '", tensor, "' but the model has no such ", frozen_whole ? "frozen parameter" : "buffer");
        if (!frozen_whole) continue;
        ZG_CHECK(entry.shape == known->second.shape, who, ": ", file->path(), ": tensor '", tensor, "' has shape ",
                 shape_str(entry.shape), "; the model's '", name, "' has shape ", shape_str(known->second.shape));
        check_dtype(known->second.dtype, "");
        plan.pieces[tensor].push_back({file.get(), tensor, 0, numel(entry.shape)});
        continue;
      }
      std::string role, parameter;
      int64_t begin = 0;
      if (plan.format == 0) {
        std::tie(role, parameter) = single_file_name(tensor);
      } else {
        const size_t last = tensor.rfind('/'), first = tensor.find('/');
        ZG_CHECK(first != last && last != std::string::npos &&
                     parse_number(std::string_view(tensor).substr(last + 1), begin) && begin >= 0,
                 who, ": ", file->path(), ": tensor '", tensor, "' is not named <role>/<parameter>/<first element>");
        role = tensor.substr(0, first), parameter = tensor.substr(first + 1, last - first - 1);
      }
      const bool frozen = role == "frozen";
      ZG_CHECK(role == "master" || role == "exp_avg" || role == "exp_avg_sq" || (frozen && plan.format >= 4), who,
               ": ", file->path(), ": tensor '", tensor, "' has no role master, exp_avg, exp_avg_sq",
               plan.format >= 4 ? " or frozen" : "");
      // A trained parameter's pieces load into a model that has it frozen too (its master
      // weights become the frozen weights; its Adam state goes unused).
      const auto frozen_now = model.frozen.find(parameter), trained_now = model.trained.find(parameter);
      const bool known = frozen_now != model.frozen.end() || (!frozen && trained_now != model.trained.end());
      ZG_CHECK(known, who, ": ", file->path(), " holds '", tensor, "' but the model has no ", frozen ? "frozen " : "",
               "parameter '", parameter, "'",
               trained_now != model.trained.end() ? " (it trains it: the save has no Adam state for it)" : "");
      const auto [held_shape, held_dtype] = (frozen_now != model.frozen.end() ? frozen_now : trained_now)->second;
      if (plan.format == 0) {  // a whole tensor, shaped as the parameter
        ZG_CHECK(entry.shape == held_shape, who, ": ", file->path(), ": tensor '", tensor, "' has shape ",
                 shape_str(entry.shape), "; the model's '", parameter, "' has shape ", shape_str(held_shape),
                 ": a checkpoint of another model");
        check_dtype(held_dtype, "");
      } else {
        ZG_CHECK(entry.shape.size() == 1, who, ": ", file->path(), ": tensor '", tensor, "' is ", name(entry.dtype),
                 shape_str(entry.shape), ", expected a 1-D piece");
        check_dtype(held_dtype, "1-D ");
        const auto shape = file->metadata().find("shape/" + parameter);
        const bool shapes_recorded = plan.format >= 2;
        ZG_CHECK(!shapes_recorded || (shape != file->metadata().end() && shape->second == shape_str(held_shape)),
                 who, ": ", file->path(), ": tensor '", tensor, "' is a piece of a parameter of shape ",
                 shape == file->metadata().end() ? std::string("(not recorded)") : shape->second, "; the model's '",
                 parameter, "' has shape ", shape_str(held_shape), ": a checkpoint of another model");
      }
      const int64_t size = numel(held_shape), length = numel(entry.shape);
      ZG_CHECK(begin <= size && length <= size - begin, who, ": ", file->path(), ": tensor '", tensor,
               "' holds elements [", begin, ", ", begin + length, ") but the model's '", parameter, "' has ", size,
               " (shape ", shape_str(held_shape), "): a checkpoint of another model");
      plan.pieces[role + "/" + parameter].push_back({file.get(), tensor, begin, length});
    }
  for (auto& [key, list] : plan.pieces) {
    std::sort(list.begin(), list.end(), [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
    for (size_t i = 1; i < list.size(); ++i)
      ZG_CHECK(list[i - 1].begin + list[i - 1].length <= list[i].begin, who, ": ", dir, ": pieces '",
               list[i - 1].tensor, "' (", list[i - 1].file->path(), ") and '", list[i].tensor, "' (",
               list[i].file->path(), ") overlap");
  }
  // A parameter frozen now that the save trained: its master weights.
  for (const auto& [name, shape] : model.frozen) {
    const std::string key = std::string(kFrozenKey) + name, master = "master/" + name;
    if (!plan.pieces.contains(key) && plan.pieces.contains(master)) plan.pieces[key] = plan.pieces[master];
  }
  // Each part this rank loads, covered by pieces it can read into it, their bytes verified
  // (each piece once). (Saves before format 3 held no frozen parameters: those are left as they are.)
  std::set<std::tuple<const SafetensorsFile*, std::string, DType>> verified;  // and checked as that dtype
  for (const Part& part : parts) {
    if (plan.format < 3 && part.key.starts_with(kFrozenKey) && !plan.pieces.contains(part.key)) continue;
    const int64_t a = part.begin, b = part.begin + part.data.numel();
    int64_t covered = 0;
    for (const Piece& p : plan.pieces[part.key]) {
      const int64_t overlap = std::min(b, p.begin + p.length) - std::max(a, p.begin);
      if (overlap <= 0) continue;
      covered += overlap;
      if (verified.emplace(p.file, p.tensor, part.data.dtype()).second) p.file->check_readable_as(p.tensor, part.data.dtype());
    }
    ZG_CHECK(covered == b - a, who, ": ", dir, " does not cover ", part.key, " elements [", a, ", ", b, ") (",
             covered, " of ", b - a, " found)");
    plan.parts.push_back(part);
  }
  return plan;
}

}  // namespace

// Each rank plans its part, every byte it will read verified; then all ranks agree, so
// that either every rank loads or none does -- a rank whose range is not covered, or
// whose file is damaged, must not leave the others loaded.
Metadata ShardedModel::load(const std::string& dir, optim::GradScaler* scaler) {
  NoGradGuard no_grad;
  const int r = group_.rank();
  ModelParameters model;
  nn::NamedTensors buffers;
  for (const auto& unit : units_) {
    for (const auto& e : unit->entries()) model.trained[e.name] = {e.shape, unit->master().dtype()};
    for (const auto& e : unit->frozen_entries()) model.frozen[e.name] = {e.shape, unit->frozen_shard().dtype()};
  }
  for (const auto& [key, t] : replicated()) {
    if (key.starts_with(kFrozenKey)) model.frozen[key.substr(kFrozenKey.size())] = {t.shape(), t.dtype()};
    else buffers.emplace_back(key, t);
  }
  LoadPlan plan;
  std::string save;  // the folder (or file) of the save `dir` holds now
  const Device device = context_->device;
  all_or_none(group_, device, "ShardedModel::load", "nothing was loaded, on any rank", [&] {
    save = checkpoint_dir::current_save(dir, "ShardedModel::load");
    plan = plan_load(save, model,
                     parts_of(units_, replicated(), shard_group().rank(), !placement().optimizer_sharded(), /*saving=*/false),
                     buffers, r, scaler);
  });
  // One save on every rank (a save made current between two ranks' reads of `latest` is another).
  Hash53 which;
  for (const std::string& key : {"save_id", "step"}) {
    const auto it = plan.files[0]->metadata().find(key);
    const std::string value = it == plan.files[0]->metadata().end() ? "" : it->second;
    which.mix(value.data(), value.size() + 1);
  }
  Agreement(group_, agreement_device(group_, device), {{"save (its id and step)", which.value()}})
      .check("ShardedModel::load: nothing was loaded, on any rank: ranks found");

  // Everything checked, everywhere: now copy each part's overlap with each piece.
  for (const Part& part : plan.parts) {
    const int64_t a = part.begin, b = part.begin + part.data.numel();
    for (const Piece& p : plan.pieces.at(part.key)) {
      const int64_t lo = std::max(a, p.begin), hi = std::min(b, p.begin + p.length);
      if (hi <= lo) continue;
      const Tensor data = p.file->read(p.tensor).reshape({-1});
      Tensor(part.data.narrow(0, lo - a, hi - lo)).copy_(data.narrow(0, lo - p.begin, hi - lo));
    }
    if (part.whole.defined()) Tensor(part.whole).copy_(part.data.view(part.whole.shape()));
  }
  if (plan.format >= 3)
    for (const auto& [key, t] : buffers) plan.files.front()->read_into(key, t);
  step_ = plan.step;
  if (plan.scaler) scaler->set_scale(plan.scaler->scale, plan.scaler->good_steps);
  Generator& gen = Context::current().generator();
  gen.manual_seed(plan.seed);
  gen.set_offset(plan.offset);
  for (auto& unit : units_) unit->refresh_compute();
  mark_compute_current();
  Metadata loaded = plan.files[0]->metadata();
  loaded["path"] = save;
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

// The consolidated state's order: the trained parameters unit by unit, the replicated
// frozen parameters and buffers, then stage 3's frozen parameters unit by unit.
std::vector<SafetensorsWriter::Layout> ShardedModel::consolidated_layout() const {
  const DType master_dtype = optim::master_dtype_for(config_.compute_dtype);
  std::vector<SafetensorsWriter::Layout> layout;
  for (const auto& unit : units_)
    for (const auto& e : unit->entries()) layout.push_back({e.name, unit->master().dtype(), e.shape});
  for (const auto& [key, t] : replicated()) layout.push_back(consolidated_entry(key, t, master_dtype));
  for (const auto& unit : units_)
    for (const auto& e : unit->frozen_entries()) layout.push_back({e.name, master_dtype, e.shape});
  return layout;
}

void ShardedModel::for_each_consolidated(const std::function<void(const std::string&, const Tensor&)>& fn) {
  NoGradGuard no_grad;
  const DType master_dtype = optim::master_dtype_for(config_.compute_dtype);
  for (auto& unit : units_) {
    // Full optimizer state: every rank has it all. Else one unit's master weights, gathered and released.
    const Tensor whole = placement().optimizer_sharded()
                             ? all_gathered(unit->master(), unit->tag(), MemoryCategory::communication)
                             : unit->master();
    for (const auto& e : unit->entries()) fn(e.name, view_of(whole, e));
  }
  for (const auto& [key, t] : replicated()) {
    const SafetensorsWriter::Layout entry = consolidated_entry(key, t, master_dtype);
    fn(entry.name, t.to(entry.dtype));
  }
  for (auto& unit : units_) {  // stage 3's frozen parameters: each unit's gathered, then released
    if (!unit->frozen_shard().defined()) continue;
    const Tensor whole = all_gathered(unit->frozen_shard(), unit->tag(), MemoryCategory::communication);
    for (const auto& e : unit->frozen_entries()) fn(e.name, view_of(whole, e).to(master_dtype));
  }
}

nn::NamedTensors ShardedModel::consolidated_state() {
  nn::NamedTensors state;
  for_each_consolidated([&](const std::string& name, const Tensor& value) {
    MemoryScope scope(MemoryCategory::other);
    state.emplace_back(name, value.clone());
  });
  return state;
}

// Rank 0 writes each unit's weights as they are gathered: no rank holds more than one
// unit's at a time, as FSDP's full state dict with rank0_only and offload to the CPU.
void ShardedModel::export_consolidated(const std::string& path) {
  GroupFileWriter file(group_, context_->device, "ShardedModel::export_consolidated",
                       group_.rank() == 0, path, consolidated_layout(), {{"format", "zerograd-consolidated-1"}});
  for_each_consolidated([&](const std::string& name, const Tensor& value) { file.write(name, value); });
  file.commit(path + " was not written");
}

}  // namespace zg::dist
