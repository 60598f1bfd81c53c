#include "optim/checkpoint.h"

#include <cmath>
#include <cstdio>
#include <set>

#include "tensor/context.h"

namespace zg::optim {

namespace {

// Numbers in metadata are text (the format's rule); doubles are written exactly.
std::string exact(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

// m and v are laid out by the entries of `params`: an AdamW built on another
// FlatParameters has other offsets (or another length) for them.
void check_same_parameters(const char* op, const FlatParameters& params, const AdamW& adamw) {
  ZG_CHECK(&adamw.params == &params, op, ": the AdamW was built on another FlatParameters (", adamw.params.entries.size(),
           " parameters, ", adamw.params.numel(), " elements) than the one given (", params.entries.size(),
           " parameters, ", params.numel(), " elements)");
}

// One tensor of a checkpoint: its name in the file and its view into a flat buffer.
struct Slot {
  std::string name;
  Tensor view;
};

// Every tensor of a checkpoint: master weights, then Adam m, then v, by parameter name.
std::vector<Slot> checkpoint_slots(const FlatParameters& params, const AdamW& adamw) {
  std::vector<Slot> slots;
  for (const auto& [prefix, flat] : {std::pair<std::string, const Tensor*>{"", &params.master},
                                     {"optimizer.exp_avg.", &adamw.m},
                                     {"optimizer.exp_avg_sq.", &adamw.v}})
    for (const auto& e : params.entries) slots.push_back({prefix + e.name, FlatParameters::view_of(*flat, e)});
  return slots;
}

}  // namespace

void save_checkpoint(const std::string& path, const FlatParameters& params, const AdamW& adamw,
                     const GradScaler* scaler, const Metadata& extra) {
  check_same_parameters("save_checkpoint", params, adamw);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (Slot& slot : checkpoint_slots(params, adamw)) tensors.emplace_back(std::move(slot.name), std::move(slot.view));
  Metadata meta = extra;
  const Generator& gen = Context::current().generator();
  meta["format"] = "zerograd-training-checkpoint-1";
  meta["step"] = std::to_string(adamw.steps());
  meta["compute_dtype"] = name(params.compute_dtype());
  meta["rng_seed"] = std::to_string(gen.seed());
  meta["rng_offset"] = std::to_string(gen.offset());
  write_scaler_state(scaler, meta);
  save_safetensors(path, tensors, meta);
}

void write_scaler_state(const GradScaler* scaler, Metadata& meta) {
  if (!scaler || !scaler->enabled()) return;
  meta["loss_scale"] = exact(scaler->scale_factor());
  meta["loss_scale_good_steps"] = std::to_string(scaler->good_steps());
}

std::optional<ScalerState> read_scaler_state(const Metadata& meta, const GradScaler* scaler, const std::string& path,
                                             const char* who) {
  if (!scaler || !scaler->enabled() || !meta.count("loss_scale")) return std::nullopt;
  const ScalerState state{metadata_number<double>(meta, "loss_scale", path, who),
                          metadata_number<int64_t>(meta, "loss_scale_good_steps", path, who)};
  ZG_CHECK(GradScaler::is_valid_scale(state.scale) && state.good_steps >= 0, who, ": ", path,
           ": metadata loss_scale = ", state.scale, " and loss_scale_good_steps = ", state.good_steps,
           " are not a valid scale and a count");
  return state;
}

Metadata load_checkpoint(const std::string& path, FlatParameters& params, AdamW& adamw, GradScaler* scaler) {
  check_same_parameters("load_checkpoint", params, adamw);
  const SafetensorsFile file(path);
  const Metadata& meta = file.metadata();
  const auto format = meta.find("format");
  ZG_CHECK(format != meta.end() && format->second == "zerograd-training-checkpoint-1", "load_checkpoint: ", path,
           " is not a zerograd training checkpoint (no format metadata)");
  // Parse everything before changing anything, so a bad file leaves the run as it was.
  const auto step = metadata_number<int64_t>(meta, "step", path, "load_checkpoint");
  ZG_CHECK(step >= 0 && step < INT64_MAX, "load_checkpoint: ", path, ": metadata 'step' = ", step,
           " is not a count of updates that can go on");
  const std::optional<ScalerState> scaler_state = read_scaler_state(meta, scaler, path, "load_checkpoint");
  const auto seed = metadata_number<uint64_t>(meta, "rng_seed", path, "load_checkpoint");
  const auto offset = metadata_number<uint64_t>(meta, "rng_offset", path, "load_checkpoint");
  const std::vector<Slot> slots = checkpoint_slots(params, adamw);
  std::set<std::string> expected;
  for (const Slot& slot : slots) {
    const auto& entry = file.entry(slot.name);
    ZG_CHECK(entry.shape == slot.view.shape() && entry.dtype == slot.view.dtype(), "load_checkpoint: ", path, ": '",
             slot.name, "' is ", name(entry.dtype), shape_str(entry.shape), ", expected ", describe(slot.view));
    expected.insert(slot.name);
  }
  // A tensor the parameters lack: a checkpoint of another (larger) model, whose state
  // would be dropped without a word.
  for (const std::string& tensor : file.names())
    ZG_CHECK(expected.count(tensor), "load_checkpoint: ", path, " has a tensor '", tensor,
             "' that none of the parameters given has; it is a checkpoint of another model");
  for (const Slot& slot : slots) file.read_into(slot.name, slot.view);
  params.sync_compute_from_master();
  adamw.set_steps(step);
  if (scaler_state) scaler->set_scale(scaler_state->scale, scaler_state->good_steps);
  Generator& gen = Context::current().generator();
  gen.manual_seed(seed);
  gen.set_offset(offset);
  return meta;
}

}  // namespace zg::optim
