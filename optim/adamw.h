// AdamW over flat spans (FlatParameters), with fp32 master weights, Adam moments
// m and v in f32, and the compute copy (bf16/f16) rewritten in the same call.
#pragma once

#include <vector>

#include "optim/flat_parameters.h"

namespace zg::optim {

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.01;  // applied to the decay span only (matrices, embeddings)
};
// Throws zg::Error naming the option unless 0 <= beta1, beta2 < 1, eps > 0 and
// weight_decay >= 0, all finite.
void check_options(const AdamWOptions& options);

// One contiguous run of parameters with its optimizer state, all [n]: the unit an
// update works on. The dist layer builds these from its shards.
struct AdamWSpan {
  Tensor master, grad, m, v;
  Tensor compute;  // the compute-dtype copy to rewrite; undefined when master is the parameter itself
  bool weight_decay = true;
};

// One AdamW update of every span (the fused backend kernel per span). step counts
// from 1 (the bias corrections divide by 1 - beta^step); lr and grad_scale are finite
// and >= 0. device_scale (optional, one f32 on the spans' device) multiplies grad_scale on the
// device: a clipping coefficient that was never read back to the host.
void adamw_update(const std::vector<AdamWSpan>& spans, const AdamWOptions& options, double lr, int64_t step,
                  double grad_scale, const Tensor& device_scale = {});

class AdamW {
 public:
  AdamW(FlatParameters& params, AdamWOptions options = {});
  // One update of every span. grad_scale multiplies the gradients first: 1 / loss scale,
  // times the clipping coefficient -- or that coefficient stays on the device, in
  // device_scale (optim::clip_coefficient_on_device), and the step never waits for it.
  void step(double lr, double grad_scale = 1.0, const Tensor& device_scale = {});
  int64_t steps() const { return step_; }
  void set_steps(int64_t step);  // the updates already made (a resumed run): >= 0

  FlatParameters& params;
  AdamWOptions options;
  Tensor m, v;  // [n] in the master's dtype (f32; f64 for f64 training), `optimizer_state`

 private:
  int64_t step_ = 0;
};

}  // namespace zg::optim
