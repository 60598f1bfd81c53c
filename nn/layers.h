// The layers of a GPT -- Linear, Embedding, LayerNorm, GELU, Dropout -- and of a Llama --
// RMSNorm, SiLU, SwiGLU -- and Sequential. Each registers its parameters with the names
// PyTorch uses (weight, bias), so checkpoints and named_parameters() read the same in both.
#pragma once

#include <optional>

#include "autograd/functions.h"
#include "nn/module.h"
#include "nn/sequence_pieces.h"

namespace zg::nn {

// y = x W^T + b, W [out, in] (PyTorch's layout). Initialised as torch.nn.Linear -- W and b
// U(-1/sqrt(in), 1/sqrt(in)), kaiming_uniform_ with a = sqrt(5) -- or, given init_std,
// W ~ N(0, init_std) and b = 0 (GPT-2's and Llama's choice, which their models pass).
// An activation, if given, is applied in the same op (zg::linear: on CUDA a GEMM
// epilogue), so y = act(x W^T + b) -- the parameters are the plain layer's.
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true, std::optional<double> init_std = std::nullopt,
         TensorOptions options = {}, Activation activation = Activation::none);
  Tensor forward(const Tensor& x) override;
  Tensor weight, bias;
  Activation activation;
};

// out[...] = weight[index[...]]; weight [num, dim] ~ N(0, init_std).
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim, double init_std = 0.02, TensorOptions options = {});
  Tensor forward(const Tensor& indices) override;
  Tensor weight;
  // Set when the table is one rank's rows of a vocabulary cut across ranks
  // (dist::parallelize_module): weight's rows are ids [first_id, first_id + num), and
  // every other id looks up zeros, so the ranks' outputs sum to the whole table's.
  std::optional<int64_t> first_id;
};

// Ids (any shape, i32/i64) against rows [first, first + count) of a table: where each
// falls outside them, and each id less `first`, 0 there (an index always in range).
struct RowIds {
  Tensor outside, local;
};
RowIds ids_in_rows(const Tensor& ids, int64_t first, int64_t count);
// embedding(weight, ids) for a weight that is rows [first, first + rows) of a larger
// table: those ids' rows, zeros for every other id.
Tensor embedding_rows(const Tensor& weight, const Tensor& ids, int64_t first);

// Normalises the last dim: (x - mean) / sqrt(var + eps) * weight + bias; weight 1, bias 0.
class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, double eps = 1e-5, bool bias = true, TensorOptions options = {});
  Tensor forward(const Tensor& x) override;
  Tensor weight, bias;
  double eps;
};

// GPT-2's tanh-approximated GELU as a module (for Sequential-style models).
class GELU : public Module {
 public:
  Tensor forward(const Tensor& x) override { return gelu(x); }
};

// In training, zeroes each element with probability p and scales the rest by 1/(1-p);
// the mask comes from the rank's Philox generator, so a run is reproducible (and
// activation checkpointing replays the same mask). Identity in eval mode.
class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.1);
  Tensor forward(const Tensor& x) override;
  double p;
  // The input is piece `part` of `parts` equal pieces along `part_dim` of the whole
  // activation (a rank's rows under sequence parallelism): its mask is that piece of the
  // whole one's (zg::dropout_part), so the model drops as one rank does.
  int64_t part_dim = 0;
  int part = 0, parts = 1;
  // Under context parallelism the input holds these pieces of the whole sequence along
  // part_dim (dist::parallelize_context sets them); sequence parallelism's part is then a
  // part of these rows.
  SequencePieces sequence;
};

using zg::dropout;  // the op (autograd/functions.h), as nn::dropout too

// x / sqrt(mean(x^2) + eps) * weight over the last dim (zg::rms_norm); weight 1.
class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t dim, double eps = 1e-6, TensorOptions options = {});
  Tensor forward(const Tensor& x) override;
  Tensor weight;
  double eps;
};

class SiLU : public Module {
 public:
  Tensor forward(const Tensor& x) override { return silu(x); }
};

// Llama's MLP (Shazeer 2020, "GLU variants"): down_proj(silu(gate_proj(x)) * up_proj(x)),
// hidden size `hidden`, no biases by default; weights N(0, init_std).
class SwiGLU : public Module {
 public:
  SwiGLU(int64_t dim, int64_t hidden, bool bias = false, double init_std = 0.02, TensorOptions options = {});
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Linear> gate_proj, up_proj, down_proj;
};

// Modules called in turn, each through operator() (its hooks run), named "0", "1", ... as
// torch.nn.Sequential: Sequential{linear, std::make_shared<GELU>(), linear2}.
class Sequential : public ModuleList {
 public:
  Sequential() = default;
  Sequential(std::initializer_list<std::shared_ptr<Module>> modules);
  Tensor forward(const Tensor& x) override;
};

}  // namespace zg::nn
