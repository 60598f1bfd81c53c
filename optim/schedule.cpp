#include "optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "autograd/functions.h"
#include "autograd/graph.h"

namespace zg::optim {

double warmup_cosine_lr(int64_t step, double max_lr, double min_lr, int64_t warmup, int64_t total) {
  ZG_CHECK(step >= 0 && warmup >= 0, "warmup_cosine_lr: step and warmup count from 0, got step ", step,
           " and warmup ", warmup);
  ZG_CHECK(std::isfinite(max_lr) && max_lr >= 0 && std::isfinite(min_lr) && min_lr >= 0,
           "warmup_cosine_lr: max_lr and min_lr must be >= 0 and finite, got ", max_lr, " and ", min_lr);
  // The fraction first: max_lr (step + 1) could overflow where the result does not.
  if (step < warmup) return max_lr * (static_cast<double>(step + 1) / static_cast<double>(warmup));
  if (step >= total) return min_lr;
  const double t = static_cast<double>(step - warmup) / static_cast<double>(std::max<int64_t>(total - warmup, 1));
  return min_lr + (max_lr - min_lr) * 0.5 * (1.0 + std::cos(M_PI * t));
}

namespace {
void check_max_norm(const char* who, double max_norm) {
  ZG_CHECK(!std::isnan(max_norm), who, ": max_norm is NaN (0 or less disables clipping)");
}
}  // namespace

Tensor clip_coefficient_on_device(const Tensor& norm, double max_norm) {
  check_max_norm("clip_coefficient_on_device", max_norm);  // min(NaN, 1) would scale every update by NaN
  ZG_CHECK(norm.defined() && norm.numel() == 1 && is_floating(norm.dtype()),
           "clip_coefficient_on_device: expected a norm of one floating element, got ", describe(norm));
  NoGradGuard no_grad;
  const Tensor one = ones_like(norm);
  if (max_norm <= 0) return one;
  // A max_norm past f32's range clips nothing, like inf (full_like refuses what f32 cannot hold).
  const double limit = max_norm > std::numeric_limits<float>::max() ? INFINITY : max_norm;
  const Tensor coefficient = minimum(div(full_like(norm, limit), add(norm, 1e-6)), 1.0);
  return where(lt(norm, INFINITY), coefficient, one);
}

double clip_coefficient(double norm, double max_norm) {
  check_max_norm("clip_coefficient", max_norm);
  if (max_norm <= 0 || !std::isfinite(norm)) return 1.0;
  return std::min(1.0, max_norm / (norm + 1e-6));
}

}  // namespace zg::optim
