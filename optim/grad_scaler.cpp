#include "optim/grad_scaler.h"

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <limits>

#include "autograd/functions.h"

namespace zg::optim {

GradScaler::GradScaler(GradScalerOptions options) : options_(options), scale_(options.enabled ? options.init_scale : 1.0) {
  const GradScalerOptions& o = options_;
  ZG_CHECK(is_valid_scale(o.init_scale),
           "GradScaler: init_scale must be positive, with it and its inverse finite in f32, got ", o.init_scale);
  ZG_CHECK(std::isfinite(o.growth_factor) && o.growth_factor > 1, "GradScaler: growth_factor must be > 1, got ",
           o.growth_factor);
  ZG_CHECK(o.backoff_factor > 0 && o.backoff_factor < 1, "GradScaler: backoff_factor must lie in (0, 1), got ",
           o.backoff_factor);
  ZG_CHECK(o.growth_interval > 0, "GradScaler: growth_interval must be positive, got ", o.growth_interval);
}

bool GradScaler::is_valid_scale(double scale) {
  constexpr double kF32Max = std::numeric_limits<float>::max();
  return scale > 0 && scale <= kF32Max && 1.0 / scale <= kF32Max;
}

void GradScaler::set_scale(double scale, int64_t good_steps) {
  ZG_CHECK(options_.enabled, "GradScaler: set_scale on a disabled scaler (its scale stays 1)");
  ZG_CHECK(is_valid_scale(scale),
           "GradScaler: set_scale needs a positive scale, with it and its inverse finite in f32, got ", scale);
  ZG_CHECK(good_steps >= 0, "GradScaler: set_scale needs good_steps >= 0, got ", good_steps);
  scale_ = scale;
  // More good steps than the interval grow the scale at the next good step, as the
  // interval's own count would; kept below it, the count cannot overflow.
  good_steps_ = std::min(good_steps, options_.growth_interval - 1);
}

Tensor GradScaler::scale(const Tensor& loss) const {
  if (scale_ == 1.0) return loss;
  return loss.to(accumulate_type(loss.dtype())) * scale_;
}

bool GradScaler::update(bool found_inf) {
  if (!options_.enabled) return !found_inf;
  // The scale stays where the constructor requires it (is_valid_scale): growth past f32's
  // range (an f32 loss times it would be inf, and inf * backoff stays inf: no step would
  // ever be taken again), or a backoff so deep that 1 / scale overflows, is skipped.
  const auto move_to = [&](double next) {
    if (is_valid_scale(next)) scale_ = next;
    good_steps_ = 0;
  };
  if (found_inf) {
    move_to(scale_ * options_.backoff_factor);
    return false;
  }
  if (++good_steps_ >= options_.growth_interval) move_to(scale_ * options_.growth_factor);
  return true;
}

void write_scaler_state(const GradScaler* scaler, Metadata& meta) {
  if (!scaler || !scaler->enabled()) return;
  char exact[40];  // metadata numbers are text; a double written exactly
  std::snprintf(exact, sizeof exact, "%.17g", scaler->scale_factor());
  meta["loss_scale"] = exact;
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

}  // namespace zg::optim
