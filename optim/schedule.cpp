#include "optim/schedule.h"

#include <algorithm>
#include <cmath>

#include "tensor/autograd.h"
#include "tensor/ops.h"

namespace zg::optim {

double warmup_cosine_lr(int64_t step, double max_lr, double min_lr, int64_t warmup, int64_t total) {
  ZG_CHECK(step >= 0 && warmup >= 0, "warmup_cosine_lr: step and warmup count from 0, got step ", step,
           " and warmup ", warmup);
  if (step < warmup) return max_lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (step >= total) return min_lr;
  const double t = static_cast<double>(step - warmup) / static_cast<double>(std::max<int64_t>(total - warmup, 1));
  return min_lr + (max_lr - min_lr) * 0.5 * (1.0 + std::cos(M_PI * t));
}

double grad_norm(const FlatParameters& params, double inv_scale) {
  return std::sqrt(sum_of_squares(params.grad).item<double>()) * inv_scale;
}

Tensor clip_coefficient_on_device(const FlatParameters& params, double max_norm) {
  NoGradGuard no_grad;
  const Tensor norm = sqrt(sum_of_squares(params.grad).to(DType::f32)).view({1});
  const Tensor one = ones_like(norm);
  if (max_norm <= 0) return one;
  const Tensor coefficient = minimum(div(full_like(norm, max_norm), add(norm, 1e-6)), 1.0);
  return where(lt(norm, INFINITY), coefficient, one);
}

double clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0 || !std::isfinite(norm)) return 1.0;
  return std::min(1.0, max_norm / (norm + 1e-6));
}

}  // namespace zg::optim
