#include "optim/adamw.h"

#include <cmath>

#include "tensor/backend.h"
#include "tensor/trace.h"

namespace zg::optim {

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

AdamW::AdamW(FlatParameters& p, AdamWOptions o) : params(p), options(o) {
  check_options(options);
  MemoryScope scope(MemoryCategory::optimizer_state);
  const TensorOptions state = TensorOptions(params.master.dtype()).device(params.master.device());
  m = zeros({params.numel()}, state);
  v = zeros({params.numel()}, state);
}

void AdamW::set_steps(int64_t step) {
  ZG_CHECK(step >= 0 && step < INT64_MAX, "AdamW: set_steps needs a count of updates in [0, INT64_MAX), got ", step);
  step_ = step;
}

void AdamW::step(double lr, double grad_scale, const Tensor& device_scale) {
  params.check_compute_unwritten("AdamW::step");
  std::vector<AdamWSpan> spans;
  for (const FlatParameters::Span& span : params.spans) {
    auto part = [&](const Tensor& flat) { return flat.narrow(0, span.offset, span.length); };
    spans.push_back({part(params.master), part(params.grad), part(m), part(v),
                     params.compute.is_same(params.master) ? Tensor() : part(params.compute), span.weight_decay});
  }
  adamw_update(spans, options, lr, step_ + 1, grad_scale, device_scale);
  params.mark_compute_current();
  ++step_;  // only once the update was issued: a refused one leaves the count
}

}  // namespace zg::optim
