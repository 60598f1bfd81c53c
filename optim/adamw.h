// AdamW over flat spans, with fp32 master weights, Adam moments m and v in f32, and
// the compute copy (bf16/f16) rewritten in the same call. The optimizer never sees a
// parameter or a rank: the dist layer's units hand it the spans this rank updates.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace zg::optim {

// The dtype of master weights and Adam state: f32, or f64 for f64 training.
DType master_dtype_for(DType compute_dtype);

// A parameter group, as torch.optim's param_groups: the parameters whose names match one
// of `names` (glob patterns: "*.bias", "transformer.wte.weight", "transformer.h.*.ln_?.*")
// train with lr x lr_scale and, when set, a weight decay of their own (else the options'
// for matrices and embeddings, none for vectors). A parameter takes the first group it matches.
struct ParamGroup {
  std::vector<std::string> names;
  double lr_scale = 1.0;
  std::optional<double> weight_decay{};
};

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.01;  // applied to the decay span only (matrices, embeddings)
  std::vector<ParamGroup> groups{};
};
// The first group whose patterns match `name`, or -1.
int group_of(const std::vector<ParamGroup>& groups, const std::string& name);
// Throws zg::Error naming the option unless 0 <= beta1, beta2 < 1, eps > 0 and
// weight_decay >= 0, all finite.
void check_options(const AdamWOptions& options);

// One contiguous run of parameters with its optimizer state, all [n]: what an update
// works on. The dist layer's units build these from their buffers.
struct AdamWSpan {
  Tensor master, grad, m, v;
  Tensor compute;  // the compute-dtype copy to rewrite; undefined when master is the parameter itself
  bool weight_decay = true;  // the options' weight decay, or none
  double lr_scale = 1.0;                        // a parameter group's
  std::optional<double> group_weight_decay{};   // a parameter group's own, in place of the above
};

// One AdamW update of every span (the fused backend kernel per span). step counts
// from 1 (the bias corrections divide by 1 - beta^step); lr and grad_scale are finite
// and >= 0. device_scale (optional, one element of the masters' dtype on their device) multiplies grad_scale on the
// device: a clipping coefficient that was never read back to the host.
void adamw_update(const std::vector<AdamWSpan>& spans, const AdamWOptions& options, double lr, int64_t step,
                  double grad_scale, const Tensor& device_scale = {});

}  // namespace zg::optim
