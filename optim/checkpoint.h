// Training checkpoints: everything needed to resume bit for bit, in one
// safetensors file that any safetensors reader can open.
//
//   <name>                          fp32 master weights, by parameter name (HF names)
//   optimizer.exp_avg.<name>        Adam m
//   optimizer.exp_avg_sq.<name>     Adam v
//   __metadata__                    step, loss scale, compute dtype, Philox state, and
//                                   whatever the caller adds (e.g. the data position)
//
// Keyed by parameter name rather than by offset in a flat buffer, so the same file
// loads into a FlatParameters of any packing order. (The dist layer's checkpoints are
// sharded, one file per rank: dist/zero/sharded_checkpoint.cpp.)
#pragma once

#include <optional>
#include <string>

#include "optim/adamw.h"
#include "optim/grad_scaler.h"
#include "tensor/safetensors.h"

namespace zg::optim {

void save_checkpoint(const std::string& path, const FlatParameters& params, const AdamW& adamw,
                     const GradScaler* scaler = nullptr, const Metadata& extra = {});
// Restores master weights (and the compute copy), m, v, the step count, the scaler and
// the current context's Philox state. Returns the metadata (with the caller's entries).
Metadata load_checkpoint(const std::string& path, FlatParameters& params, AdamW& adamw,
                         GradScaler* scaler = nullptr);

// A GradScaler's state in checkpoint metadata ("loss_scale", "loss_scale_good_steps"),
// shared with dist's sharded checkpoints. Written for an enabled scaler only (a disabled
// one has no state: PyTorch's empty state_dict).
void write_scaler_state(const GradScaler* scaler, Metadata& meta);
// The state to give `scaler` from `meta`, parsed and checked (errors name `who` and
// `path`) before anything changes; nullopt where nothing loads: no scaler, a disabled
// one, or a file without a scale (an enabled scaler then keeps its own).
struct ScalerState {
  double scale;
  int64_t good_steps;
};
std::optional<ScalerState> read_scaler_state(const Metadata& meta, const GradScaler* scaler, const std::string& path,
                                             const char* who);

}  // namespace zg::optim
