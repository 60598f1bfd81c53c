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
Tensor checkpoint(const std::function<Tensor(const std::vector<Tensor>&)>& fn, const std::vector<Tensor>& inputs);

}  // namespace zg::nn
