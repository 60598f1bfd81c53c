// Learning-rate schedule and gradient clipping.
#pragma once

#include <cstdint>

#include "optim/flat_parameters.h"

namespace zg::optim {

// Linear warmup to max_lr over `warmup` steps, then a cosine decay to min_lr at `total`:
//   lr = max_lr (step + 1) / warmup                                   for step < warmup
//   lr = min_lr + (max_lr - min_lr) (1 + cos(pi t)) / 2,  t = (step - warmup) / (total - warmup)
double warmup_cosine_lr(int64_t step, double max_lr, double min_lr, int64_t warmup, int64_t total);

// The global L2 norm of the gradient buffer, with `inv_scale` divided out of a scaled loss.
// One reduction over the flat buffer (accumulated in f32/f64), read back to the host.
double grad_norm(const FlatParameters& params, double inv_scale = 1.0);

// The factor that brings a gradient of norm `norm` down to `max_norm` (1 if already below;
// max_norm <= 0 disables clipping): min(1, max_norm / (norm + 1e-6)).
double clip_coefficient(double norm, double max_norm);

// The same coefficient computed where the gradients are, as a one-element f32 tensor
// for AdamW::step's device_scale: nothing is read back, so a GPU step issues its
// kernels without waiting. A non-finite norm gives 1 (as clip_coefficient). With a
// GradScaler the gradients are scaled: pass its inv_scale, as to grad_norm, and to
// AdamW::step's grad_scale too.
Tensor clip_coefficient_on_device(const FlatParameters& params, double max_norm, double inv_scale = 1.0);

}  // namespace zg::optim
