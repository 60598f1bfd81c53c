#include "optim/grad_scaler.h"

#include "tensor/ops.h"

namespace zg::optim {

Tensor GradScaler::scale(const Tensor& loss) const { return scale_ == 1.0 ? loss : loss * scale_; }

bool GradScaler::update(bool found_inf) {
  if (!options_.enabled) return !found_inf;
  if (found_inf) {
    scale_ *= options_.backoff_factor;
    good_steps_ = 0;
    return false;
  }
  if (++good_steps_ >= options_.growth_interval) {
    scale_ *= options_.growth_factor;
    good_steps_ = 0;
  }
  return true;
}

}  // namespace zg::optim
