// Learning-rate schedule and gradient clipping.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace zg::optim {

// Linear warmup to max_lr over `warmup` steps, then a cosine decay to min_lr at `total`:
//   lr = max_lr (step + 1) / warmup                                   for step < warmup
//   lr = min_lr + (max_lr - min_lr) (1 + cos(pi t)) / 2,  t = (step - warmup) / (total - warmup)
double warmup_cosine_lr(int64_t step, double max_lr, double min_lr, int64_t warmup, int64_t total);

// The factor that brings a gradient of norm `norm` down to `max_norm` (1 if already below;
// max_norm <= 0 disables clipping): min(1, max_norm / (norm + 1e-6)).
double clip_coefficient(double norm, double max_norm);

// The same coefficient from a norm that stays on the device (one f32 element), as a
// tensor for adamw_update's device_scale: nothing is read back, so a GPU step issues its
// kernels without waiting. A non-finite norm gives 1 (as clip_coefficient).
Tensor clip_coefficient_on_device(const Tensor& norm, double max_norm);

}  // namespace zg::optim
