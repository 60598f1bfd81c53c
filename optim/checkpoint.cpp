#include "optim/checkpoint.h"

#include <cmath>
#include <cstdio>

#include "tensor/context.h"

namespace zg::optim {

namespace {

// Numbers in metadata are text (the format's rule); doubles are written exactly.
std::string exact(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

}  // namespace

void save_checkpoint(const std::string& path, const FlatParameters& params, const AdamW& adamw,
                     const GradScaler* scaler, const Metadata& extra) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& e : params.entries) tensors.emplace_back(e.name, FlatParameters::view_of(params.master, e));
  for (const auto& e : params.entries)
    tensors.emplace_back("optimizer.exp_avg." + e.name, FlatParameters::view_of(adamw.m, e));
  for (const auto& e : params.entries)
    tensors.emplace_back("optimizer.exp_avg_sq." + e.name, FlatParameters::view_of(adamw.v, e));
  Metadata meta = extra;
  const Generator& gen = Context::current().generator();
  meta["format"] = "zerograd-training-checkpoint-1";
  meta["step"] = std::to_string(adamw.steps());
  meta["compute_dtype"] = name(params.compute_dtype());
  meta["rng_seed"] = std::to_string(gen.seed());
  meta["rng_offset"] = std::to_string(gen.offset());
  if (scaler) {
    meta["loss_scale"] = exact(scaler->scale_factor());
    meta["loss_scale_good_steps"] = std::to_string(scaler->good_steps());
  }
  save_safetensors(path, tensors, meta);
}

Metadata load_checkpoint(const std::string& path, FlatParameters& params, AdamW& adamw, GradScaler* scaler) {
  const SafetensorsFile file(path);
  const Metadata& meta = file.metadata();
  const auto format = meta.find("format");
  ZG_CHECK(format != meta.end() && format->second == "zerograd-training-checkpoint-1", "load_checkpoint: ", path,
           " is not a zerograd training checkpoint (no format metadata)");
  // Parse everything before changing anything, so a bad file leaves the run as it was.
  const auto step = metadata_number<int64_t>(meta, "step", path, "load_checkpoint");
  ZG_CHECK(step >= 0 && step < INT64_MAX, "load_checkpoint: ", path, ": metadata 'step' = ", step,
           " is not a count of updates that can go on");
  const bool has_scale = scaler && meta.count("loss_scale");
  const double loss_scale = has_scale ? metadata_number<double>(meta, "loss_scale", path, "load_checkpoint") : 1.0;
  const int64_t good_steps =
      has_scale ? metadata_number<int64_t>(meta, "loss_scale_good_steps", path, "load_checkpoint") : 0;
  ZG_CHECK(std::isfinite(loss_scale) && loss_scale > 0 && std::isfinite(1 / loss_scale) && good_steps >= 0, "load_checkpoint: ", path,
           ": metadata loss_scale = ", loss_scale, " and loss_scale_good_steps = ", good_steps,
           " are not a positive scale and a count");
  const auto seed = metadata_number<uint64_t>(meta, "rng_seed", path, "load_checkpoint");
  const auto offset = metadata_number<uint64_t>(meta, "rng_offset", path, "load_checkpoint");
  for (const auto& e : params.entries)
    for (const std::string& prefix : {std::string(), std::string("optimizer.exp_avg."), std::string("optimizer.exp_avg_sq.")}) {
      const auto& entry = file.entry(prefix + e.name);
      ZG_CHECK(entry.shape == e.shape && entry.dtype == params.master.dtype(), "load_checkpoint: ", path, ": '",
               prefix + e.name, "' is ", name(entry.dtype), shape_str(entry.shape), ", expected ",
               name(params.master.dtype()), shape_str(e.shape));
    }
  for (const auto& e : params.entries) {
    file.read_into(e.name, FlatParameters::view_of(params.master, e));
    file.read_into("optimizer.exp_avg." + e.name, FlatParameters::view_of(adamw.m, e));
    file.read_into("optimizer.exp_avg_sq." + e.name, FlatParameters::view_of(adamw.v, e));
  }
  params.sync_compute_from_master();
  adamw.set_steps(step);
  if (has_scale) scaler->set_scale(loss_scale, good_steps);
  Generator& gen = Context::current().generator();
  gen.manual_seed(seed);
  gen.set_offset(offset);
  return meta;
}

}  // namespace zg::optim
