#include "optim/adamw.h"

namespace zg::optim {

AdamW::AdamW(FlatParameters& p, AdamWOptions o) : params(p), options(o) {
  MemoryScope scope(MemoryCategory::optimizer_state);
  const TensorOptions f32 = TensorOptions(DType::f32).device(params.master.device());
  m = zeros({params.numel()}, f32);
  v = zeros({params.numel()}, f32);
}

void AdamW::step(double lr, double grad_scale) {
  ++step_;
  for (const FlatParameters::Span& span : params.spans) {
    if (span.length == 0) continue;
    auto part = [&](const Tensor& flat) { return flat.narrow(0, span.offset, span.length); };
    AdamWStep s{lr, options.beta1, options.beta2, options.eps, span.weight_decay ? options.weight_decay : 0.0,
                grad_scale, step_};
    const Tensor compute = params.compute.is_same(params.master) ? Tensor() : part(params.compute);
    backend(params.master.device()).adamw(part(params.master), part(params.grad), part(m), part(v), compute, s);
  }
  params.master.storage()->bump_version();
  params.compute.storage()->bump_version();
}

}  // namespace zg::optim
