// Activation checkpointing: run a piece of the forward without keeping its
// intermediate activations, and recompute them during backward.
#pragma once

#include <functional>
#include <vector>

#include "tensor/tensor.h"

namespace zg::nn {

// out = fn(inputs), computed under no-grad; backward re-runs fn with grad enabled
// (replaying the rank's Philox state, so dropout draws the same mask) and
// backpropagates through the recomputed graph. Parameters used inside fn get their
// gradients as usual; the inputs' gradients flow on to the outer graph.
// Under grad mode the output always requires grad: fn ran without a graph, so
// whether its result depends on anything that requires grad is known only when
// backward recomputes it. If it does not (fn returned a detached tensor), that
// backward contributes no gradient, which is the derivative of such an fn.
Tensor checkpoint(const std::function<Tensor(const std::vector<Tensor>&)>& fn, const std::vector<Tensor>& inputs);

}  // namespace zg::nn
