#include "optim/adamw.h"

#include "tensor/trace.h"

namespace zg::optim {

void adamw_update(const std::vector<AdamWSpan>& spans, const AdamWOptions& options, double lr, int64_t step,
                  double grad_scale, const Tensor& device_scale) {
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
  MemoryScope scope(MemoryCategory::optimizer_state);
  const TensorOptions state = TensorOptions(params.master.dtype()).device(params.master.device());
  m = zeros({params.numel()}, state);
  v = zeros({params.numel()}, state);
}

void AdamW::step(double lr, double grad_scale, const Tensor& device_scale) {
  std::vector<AdamWSpan> spans;
  for (const FlatParameters::Span& span : params.spans) {
    auto part = [&](const Tensor& flat) { return flat.narrow(0, span.offset, span.length); };
    spans.push_back({part(params.master), part(params.grad), part(m), part(v),
                     params.compute.is_same(params.master) ? Tensor() : part(params.compute), span.weight_decay});
  }
  adamw_update(spans, options, lr, ++step_, grad_scale, device_scale);
}

}  // namespace zg::optim
