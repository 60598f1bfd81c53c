// Parameter initialisation in place, as torch.nn.init: each overwrites a tensor's values
// (not its shape, dtype or device) from the current rank's generator (manual_seed), with
// gradients off. Call them before a ShardedModel takes the parameters into its flat
// buffers: afterwards each rank holds only its shard (a write is then refused).
//
// Fans of a weight [out, in, k...]: fan_in = in * prod(k), fan_out = out * prod(k).
#pragma once

#include "nn/layers.h"

namespace zg::nn::init {

void normal_(const Tensor& t, double mean = 0.0, double std = 1.0);
void uniform_(const Tensor& t, double low = 0.0, double high = 1.0);
void constant_(const Tensor& t, double value);
void zeros_(const Tensor& t);
void ones_(const Tensor& t);

// Glorot and Bengio (2010): U(-a, a), a = gain sqrt(6 / (fan_in + fan_out)); normal: std = gain sqrt(2 / (fan_in + fan_out)).
void xavier_uniform_(const Tensor& t, double gain = 1.0);
void xavier_normal_(const Tensor& t, double gain = 1.0);

// He et al. (2015) for a leaky ReLU of negative slope a (0: ReLU): std = sqrt(2 / ((1 + a^2) fan)),
// uniform over +-sqrt(3) std.
enum class Fan { in, out };
void kaiming_uniform_(const Tensor& t, double a = 0.0, Fan fan = Fan::in);
void kaiming_normal_(const Tensor& t, double a = 0.0, Fan fan = Fan::in);

// PyTorch's nn.Linear default: weight and bias U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform_
// with a = sqrt(5)), what a Linear made without init_std starts from; GPT and Llama give
// theirs N(0, 0.02), and this puts such a layer back to PyTorch's start.
void linear_default_(Linear& layer);

// Applies linear_default_ to every Linear under `module`.
void linear_default_all(Module& module);

}  // namespace zg::nn::init
