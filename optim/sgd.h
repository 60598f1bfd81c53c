// SGD with momentum (PyTorch's form) over the same flat spans as AdamW:
//   g = grad * grad_scale + weight_decay * p;  buf = momentum * buf + g;  p -= lr * buf
#pragma once

#include "optim/flat_parameters.h"

namespace zg::optim {

struct SGDOptions {
  double momentum = 0.9;
  double weight_decay = 0.0;  // coupled (L2), on the decay span only
};

class SGD {
 public:
  SGD(FlatParameters& params, SGDOptions options = {});
  void step(double lr, double grad_scale = 1.0);

  FlatParameters& params;
  SGDOptions options;
  Tensor momentum_buffer;  // f32 [n], `optimizer_state`
};

}  // namespace zg::optim
