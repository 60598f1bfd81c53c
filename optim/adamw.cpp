#include "optim/adamw.h"

#include <cmath>

#include "tensor/backend.h"
#include "tensor/trace.h"

namespace zg::optim {

DType master_dtype_for(DType compute_dtype) { return accumulate_type(compute_dtype); }

void check_options(const AdamWOptions& o) {
  const auto fraction = [](double x) { return std::isfinite(x) && x >= 0 && x < 1; };
  ZG_CHECK(fraction(o.beta1) && fraction(o.beta2), "AdamW: beta1 and beta2 must lie in [0, 1), got ", o.beta1, " and ",
           o.beta2);
  ZG_CHECK(std::isfinite(o.eps) && o.eps > 0, "AdamW: eps must be positive and finite (it keeps m / (sqrt(v) + eps) "
           "finite where v is 0), got ", o.eps);
  ZG_CHECK(std::isfinite(o.weight_decay) && o.weight_decay >= 0, "AdamW: weight_decay must be >= 0 and finite, got ",
           o.weight_decay);
}

void adamw_update(const std::vector<AdamWSpan>& spans, const AdamWOptions& options, double lr, int64_t step,
                  double grad_scale, const Tensor& device_scale) {
  check_options(options);
  ZG_CHECK(std::isfinite(lr) && lr >= 0, "AdamW: lr must be >= 0 and finite, got ", lr);
  ZG_CHECK(std::isfinite(grad_scale) && grad_scale >= 0, "AdamW: grad_scale must be >= 0 and finite, got ",
           grad_scale);
  ZG_CHECK(step >= 1, "AdamW: step counts from 1 (the bias corrections divide by 1 - beta^step), got ", step);
  TraceRange range("adamw");
  for (const AdamWSpan& span : spans) {
    if (span.master.numel() == 0) continue;
    const AdamWStep s{lr, options.beta1, options.beta2, options.eps, span.weight_decay ? options.weight_decay : 0.0,
                      grad_scale, step, device_scale};
    backend(span.master.device()).adamw(span.master, span.grad, span.m, span.v, span.compute, s);
    span.master.storage()->bump_version();
    if (span.compute.defined()) span.compute.storage()->bump_version();
  }
}

}  // namespace zg::optim
