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
// loads whatever the packing (the dist layer reshards from it).
#pragma once

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

}  // namespace zg::optim
