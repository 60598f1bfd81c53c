// SGD with momentum (PyTorch's form) over the same flat spans as AdamW:
//   g = grad * grad_scale + weight_decay * p;  buf = momentum * buf + g;  p -= lr * buf
#pragma once

#include "optim/flat_parameters.h"

namespace zg::optim {

struct SGDOptions {
  double momentum = 0.9;      // >= 0 and finite (0: plain SGD)
  double weight_decay = 0.0;  // coupled (L2), on the decay span only; >= 0 and finite
};

class SGD {
 public:
  SGD(FlatParameters& params, SGDOptions options = {});
  // lr and grad_scale (1 / loss scale, times a clipping coefficient) are >= 0 and finite.
  void step(double lr, double grad_scale = 1.0);

  FlatParameters& params;
  SGDOptions options;
  Tensor momentum_buffer;  // [n] in the master's dtype (f32; f64 for f64 training), `optimizer_state`
};

}  // namespace zg::optim
