// Tensor parallelism as data (Megatron-LM's parallel layers; PyTorch's parallelize_module
// with ColwiseParallel / RowwiseParallel): which modules a model cuts across a group of T
// ranks, and how. A model supplies its own (Module::parallel_plan: GPT and Llama name
// their layers), or a user writes one; dist::parallelize_module carries it out, so
// nothing below the dist layer knows about groups.
//
// A transformer block needs four styles. Attention and the MLP are each a colwise layer
// (heads, or hidden features, cut) followed by a rowwise one (their partial outputs
// summed): one all-reduce forward, one backward, per sub-layer (Shoeybi et al. 2019).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace zg::nn {

enum class ParallelStyle : uint8_t {
  // A Linear's output features (W's rows) cut: y_r = x W_r^T + b_r, this rank's features.
  colwise,
  // A Linear's input features (W's columns) cut, its input already cut alike (a colwise
  // layer's output): y = (sum over ranks of x_r W_r^T) + b, the bias whole on every rank.
  rowwise,
  // An Embedding's rows (the vocabulary) cut: each id's row comes from the rank holding it.
  vocab_embedding,
  // No parameter cut: the module's output enters colwise layers that follow it, so its
  // gradient is the sum of theirs (copy_to_group). Before a tied head, or q, k and v.
  copy_output,
  // Sequence parallelism's seams (nothing without it): a norm that runs on sequence
  // shards, its weights' gradients summed over the ranks; the first block, whose input
  // is cut into the ranks' sequence shards; a Dropout on sequence shards (after a
  // rowwise layer), its mask the one-rank mask's rows.
  sequence_norm,
  scatter_input,
  sequence_dropout,
};
const char* name(ParallelStyle style);

struct ParallelRule {
  std::string module;  // a module path, or a glob pattern ("transformer.h.*.attn.c_attn")
  ParallelStyle style;
  // colwise: W's rows are `chunks` equal blocks (a fused q, k, v projection: 3), each cut
  // alike, so rank r holds its heads of each.
  int64_t chunks = 1;
  // colwise: the input enters through copy_to_group; false where a copy_output module
  // before it already did (one all-reduce in backward for q, k and v together).
  bool copy_input = true;
  // colwise: all-gather y along its last dim, so every rank gets every feature.
  bool gather_output = false;
};

struct ParallelPlan {
  std::vector<ParallelRule> rules;
  // Counts the model needs divisible by T, by name ({"n_head", 12}): heads cannot be cut in halves.
  std::vector<std::pair<std::string, int64_t>> must_divide;
  // A CausalLM whose head is cut along the vocabulary: its logits are each rank's shard
  // [B, T, V/T], and the loss is computed from the shards (never a [B, T, V] tensor).
  bool vocab_parallel_logits = false;
  // Sequence parallelism (Korthikanti et al. 2022): between the cut layers the activations
  // are [B, S/T, C], each rank's rows of the sequence (dim 1), so norms, residual adds and
  // their saved inputs shrink by T. A colwise layer's input is all-gathered instead of
  // copied, a rowwise layer's output reduce-scattered instead of all-reduced, a
  // copy_output module's output all-gathered (and its weights' gradients summed); the
  // same bytes as the all-reduces, half forward, half backward.
  bool sequence_parallel = false;
};

// How a parameter was cut across a tensor-parallel group: it is `chunks` equal blocks along
// `dim`, and this rank holds part `part` of `parts` equal pieces of each block.
struct TensorSplit {
  int64_t dim = 0;
  int64_t chunks = 1;
  int parts = 1;
  int part = 0;
};

}  // namespace zg::nn
