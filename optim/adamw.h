// AdamW over flat spans (FlatParameters), with fp32 master weights, Adam moments
// m and v in f32, and the compute copy (bf16/f16) rewritten in the same call.
#pragma once

#include <vector>

#include "optim/flat_parameters.h"
#include "tensor/backend.h"

namespace zg::optim {

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.01;  // applied to the decay span only (matrices, embeddings)
};

// One contiguous run of parameters with its optimizer state, all [n]: the unit an
// update works on. The dist layer builds these from its shards.
struct AdamWSpan {
  Tensor master, grad, m, v;
  Tensor compute;  // the compute-dtype copy to rewrite; undefined when master is the parameter itself
  bool weight_decay = true;
};

// One AdamW update of every span (the fused backend kernel per span).
void adamw_update(const std::vector<AdamWSpan>& spans, const AdamWOptions& options, double lr, int64_t step,
                  double grad_scale);

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
  Tensor m, v;  // [n] in the master's dtype (f32; f64 for f64 training), `optimizer_state`

 private:
  int64_t step_ = 0;
};

}  // namespace zg::optim
