#include "optim/sgd.h"

#include <cmath>

#include "autograd/functions.h"
#include "autograd/graph.h"

namespace zg::optim {

namespace {

void check_finite_nonnegative(const char* what, double x) {
  ZG_CHECK(std::isfinite(x) && x >= 0, "SGD: ", what, " must be >= 0 and finite, got ", x);
}

}  // namespace

SGD::SGD(FlatParameters& p, SGDOptions o) : params(p), options(o) {
  check_finite_nonnegative("momentum", options.momentum);
  check_finite_nonnegative("weight_decay", options.weight_decay);
  MemoryScope scope(MemoryCategory::optimizer_state);
  momentum_buffer = zeros({params.numel()}, TensorOptions(params.master.dtype()).device(params.master.device()));
}

void SGD::step(double lr, double grad_scale) {
  check_finite_nonnegative("lr", lr);
  check_finite_nonnegative("grad_scale", grad_scale);
  params.check_compute_unwritten("SGD::step");
  NoGradGuard no_grad;
  MemoryScope scope(MemoryCategory::workspace);  // the master-dtype copy of a span's gradient
  for (const FlatParameters::Span& span : params.spans) {
    if (span.length == 0) continue;
    Tensor p = params.master.narrow(0, span.offset, span.length);
    Tensor buf = momentum_buffer.narrow(0, span.offset, span.length);
    Tensor g = params.grad.narrow(0, span.offset, span.length).to(p.dtype()) * grad_scale;
    if (span.weight_decay && options.weight_decay != 0) g = g + p * options.weight_decay;
    buf.mul_(options.momentum).add_(g);
    p.add_(buf, -lr);
  }
  params.sync_compute_from_master();
}

}  // namespace zg::optim
