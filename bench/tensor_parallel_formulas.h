// zero_memory --tp T: the formulas of a GPT cut by Megatron's plan (nn::GPT::parallel_plan)
// over T ranks, per rank, beside what a dry run measures.
//
//   parameters    Ψ_cut / T + Ψ_replicated: q, k, v, the MLP's hidden features and the
//                 vocabulary are cut; layer norms, wpe and the row-parallel biases are not
//                 (each rank's share then sharded by ZeRO over the data-parallel ranks)
//   bytes sent    Megatron's 4 all-reduces of b·s·h elements a layer a step (2 forward, 2
//                 backward), plus the vocabulary-parallel embedding's (forward) and ln_f's
//                 copy to the head (backward), each a ring's 2 (T-1)/T x bytes; plus the
//                 loss's 3 all-reduces of b·s floats (the max, the target's logit, the sum)
//                 and the step's of the gradient norm's square (one f64). With sequence
//                 parallelism each all-reduce is a reduce-scatter and an all-gather, the same
//                 bytes, plus: the first block's input cut from the whole embedding (its
//                 backward an all-gather, (T-1)/T b·s·h elements) and the gradients of what
//                 runs on the sequence shards uncut (the norms, the rowwise biases: 6h a layer
//                 and ln_f's 2h) summed over tp. Not counted: step()'s agreement that every
//                 rank has the same lr and loss scale (f64[10], 80 bytes), on the tp group
//                 only where the world is one tp group
//   activations   Korthikanti et al. 2022, a layer, 16-bit: sbh (10 + 24/t + 5as/(ht)) bytes;
//                 with sequence parallelism sbh/t (34 + 5as/h)
#pragma once

#include <cstdint>

#include "nn/gpt.h"

namespace zg::bench {

// A GPT's parameters, cut by T or held whole by every tensor-parallel rank.
struct TensorParallelCounts {
  int64_t cut = 0, replicated = 0;  // Ψ_cut (all T slices together), Ψ_replicated
  int64_t per_rank(int tp) const { return cut / tp + replicated; }
};

inline TensorParallelCounts tensor_parallel_counts(const nn::GPTConfig& c) {
  const int64_t h = c.n_embd;
  // A layer: c_attn (3h x h and 3h), attn.c_proj's weight h x h, c_fc (4h x h and 4h),
  // mlp.c_proj's weight h x 4h are cut; ln_1, ln_2 (2h each) and both c_proj biases are not.
  return {.cut = c.n_layer * (12 * h * h + 7 * h) + c.vocab_size * h,
          .replicated = c.n_layer * 6 * h + c.block_size * h + 2 * h};
}

// Bytes one rank sends on the tensor-parallel group in a step of b x s tokens, `compute`
// bytes an activation element (the loss's reductions are f32, the norm's f64).
inline int64_t formula_sent_tensor_parallel(const nn::GPTConfig& c, int64_t b, int64_t s, int tp, int64_t compute,
                                            bool sp) {
  const double ring = 2.0 * (tp - 1) / tp;  // an all-reduce: a reduce-scatter and an all-gather
  const double bsh = static_cast<double>(b * s * c.n_embd * compute);
  const double activations = static_cast<double>(4 * c.n_layer + 2) * bsh;
  const double loss = 3.0 * static_cast<double>(b * s) * 4, norm = 8;
  const double shard_grads = static_cast<double>((6 * c.n_layer + 2) * c.n_embd * compute);
  const double sequence = sp ? ring / 2 * bsh + ring * shard_grads : 0;
  return static_cast<int64_t>(ring * (activations + loss + norm) + sequence);
}

// Activation bytes a rank keeps: a layer as Korthikanti et al. count it (`paper`) and as
// this code keeps it (`ours`), and the step's peak (`peak`), without activation checkpointing.
struct ActivationFormula {
  int64_t paper = 0, ours = 0, peak = 0;  // paper, ours: one layer
};

// What our kernels keep of the paper's terms, a layer, with c-byte activations (c = 2: bf16)
// and no dropout, without sequence parallelism:
//   every rank       ln_1's and ln_2's inputs, the q/k/v and fc inputs: 4c sbh   (paper: 10 sbh,
//                    its 2 more the dropout masks)
//   cut by t         q, k, v 3c sbh, the attention output c sbh, the GELU input 4c sbh and its
//                    output 4c sbh (cut, the MLP keeps it: fc and GELU are one layer, c_proj
//                    another): 12c sbh / t   (the paper's 24 sbh / t)
//   not kept         the [a, s, s] scores and probabilities, 5as/(ht) sbh: the fused attention
//                    keeps its rows' f32 log-sum-exp instead, 4 asb / t bytes
//   beyond it        each layer norm's f32 mean and 1/std, 16 sb bytes
// The peak is in the head's backward: the L layers' and the head's saved tensors (ln_f's
// input and output, 2c sbh; its statistics and the loss's per-row positions, mask and
// weights, 24 sb), with the gradients in flight: the logits' shard c sbV/t, the head's input
// c sbh, and the tied embedding's slice c Vh/t. Measured: sb + 8 bytes more (a byte a token,
// a scalar), 1 kB of 1.76 GB for 7.5b at T = 8, left out. Where another point peaks (7.5b
// at T = 4: the last layer's MLP backward, its weight gradient in flight) the measured
// peak is above this, by 0.1-0.7% in the shapes tried; not modelled.
//   With sequence parallelism the norms' inputs and statistics are cut by t (2c sbh / t,
// 16 sb / t), but the colwise layers save their all-gathered inputs whole (2c sbh: Megatron
// saves the shard and gathers it again in the backward; we do not), so a layer keeps
// 2c sbh + (14c sbh + 4as b + 16 sb) / t; at the head ln_f's input and statistics are cut
// (c sbh / t, 8 sb / t), its gathered output and the input's gradient whole (2c sbh).
inline ActivationFormula formula_activations(const nn::GPTConfig& c, int64_t b, int64_t s, int tp, int64_t bytes,
                                             bool sp) {
  const int64_t h = c.n_embd, a = c.n_head, v = c.vocab_size, sb = s * b, t = tp;
  const int64_t head_tail = 16 * sb + bytes * (sb * v + v * h) / t;  // the loss's rows; logits' and embedding's gradients
  ActivationFormula f;
  if (!sp) {
    f.paper = sb * h * 10 + sb * h * 24 / t + 5 * a * s * sb / t;
    f.ours = 4 * bytes * sb * h + 12 * bytes * sb * h / t + 4 * a * sb / t + 16 * sb;
    f.peak = c.n_layer * f.ours + 3 * bytes * sb * h + 8 * sb + head_tail;
    return f;
  }
  f.paper = (34 * sb * h + 5 * a * s * sb) / t;
  f.ours = 2 * bytes * sb * h + (14 * bytes * sb * h + 4 * a * sb + 16 * sb) / t;
  f.peak = c.n_layer * f.ours + 2 * bytes * sb * h + (bytes * sb * h + 8 * sb) / t + head_tail;
  return f;
}

}  // namespace zg::bench
