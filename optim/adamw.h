// AdamW over flat spans, with fp32 master weights, Adam moments m and v in f32, and
// the compute copy (bf16/f16) rewritten in the same call. The optimizer never sees a
// parameter or a rank: the dist layer's units hand it the spans this rank updates.
#pragma once

#include <vector>

#include "tensor/tensor.h"

namespace zg::optim {

// The dtype of master weights and Adam state: f32, or f64 for f64 training.
DType master_dtype_for(DType compute_dtype);

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.01;  // applied to the decay span only (matrices, embeddings)
};
// Throws zg::Error naming the option unless 0 <= beta1, beta2 < 1, eps > 0 and
// weight_decay >= 0, all finite.
void check_options(const AdamWOptions& options);

// One contiguous run of parameters with its optimizer state, all [n]: what an update
// works on. The dist layer's units build these from their buffers.
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

}  // namespace zg::optim
