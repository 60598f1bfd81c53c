#include "optim/sgd.h"

#include "tensor/autograd.h"
#include "tensor/ops.h"

namespace zg::optim {

SGD::SGD(FlatParameters& p, SGDOptions o) : params(p), options(o) {
  MemoryScope scope(MemoryCategory::optimizer_state);
  momentum_buffer = zeros({params.numel()}, TensorOptions(DType::f32).device(params.master.device()));
}

void SGD::step(double lr, double grad_scale) {
  NoGradGuard no_grad;
  MemoryScope scope(MemoryCategory::workspace);  // the f32 copy of a span's gradient
  for (const FlatParameters::Span& span : params.spans) {
    if (span.length == 0) continue;
    Tensor p = params.master.narrow(0, span.offset, span.length);
    Tensor buf = momentum_buffer.narrow(0, span.offset, span.length);
    Tensor g = params.grad.narrow(0, span.offset, span.length).to(DType::f32) * grad_scale;
    if (span.weight_decay && options.weight_decay != 0) g = g + p * options.weight_decay;
    buf.mul_(options.momentum).add_(g);
    p.add_(buf, -lr);
  }
  params.sync_compute_from_master();
}

}  // namespace zg::optim
