// Dynamic loss scaling for f16 training (Micikevicius et al., "Mixed Precision
// Training"): the loss is multiplied by `scale` so small gradients survive f16;
// the optimizer divides it out. A step whose gradients hold inf or NaN is
// skipped and the scale halved; after `growth_interval` good steps it doubles.
#pragma once

#include <cstdint>

#include <optional>
#include <string>

#include "tensor/safetensors.h"
#include "tensor/tensor.h"

namespace zg::optim {

struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;  // disabled: scale stays 1 and every step is taken
};

class GradScaler {
 public:
  // Throws zg::Error unless init_scale is a valid scale (is_valid_scale), growth_factor > 1,
  // 0 < backoff_factor < 1 and growth_interval > 0.
  explicit GradScaler(GradScalerOptions options = {});

  // loss * scale, in f32 for a 16-bit loss (as autocast keeps losses): the default scale,
  // 65536, is past f16's largest value, and any f16 loss above 1 times it would be inf.
  Tensor scale(const Tensor& loss) const;
  double scale_factor() const { return scale_; }
  double inv_scale() const { return 1.0 / scale_; }
  // After backward: `found_inf` says whether the gradients were finite. Returns whether
  // to take the optimizer step, and moves the scale.
  bool update(bool found_inf);
  // A resumed run's state: a valid scale, good_steps >= 0 (counted up to the growth
  // interval). Refused on a disabled scaler, whose scale stays 1.
  void set_scale(double scale, int64_t good_steps);
  int64_t good_steps() const { return good_steps_; }
  bool enabled() const { return options_.enabled; }
  // A scale the f32 loss and gradients can carry: positive, it and its inverse finite in f32.
  static bool is_valid_scale(double scale);

 private:
  GradScalerOptions options_;
  double scale_;
  int64_t good_steps_ = 0;
};

// A GradScaler's state in checkpoint metadata ("loss_scale", "loss_scale_good_steps").
// Written for an enabled scaler only (a disabled one has no state: PyTorch's empty
// state_dict).
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
