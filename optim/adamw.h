// AdamW over flat spans (FlatParameters), with fp32 master weights, Adam moments
// m and v in f32, and the compute copy (bf16/f16) rewritten in the same call.
#pragma once

#include "optim/flat_parameters.h"
#include "tensor/backend.h"

namespace zg::optim {

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.01;  // applied to the decay span only (matrices, embeddings)
};

class AdamW {
 public:
  AdamW(FlatParameters& params, AdamWOptions options = {});
  // One update of every span. grad_scale multiplies the gradients first: 1 / loss scale,
  // times the clipping coefficient.
  void step(double lr, double grad_scale = 1.0);
  int64_t steps() const { return step_; }
  void set_steps(int64_t step) { step_ = step; }

  FlatParameters& params;
  AdamWOptions options;
  Tensor m, v;  // f32 [n], `optimizer_state`

 private:
  int64_t step_ = 0;
};

}  // namespace zg::optim
