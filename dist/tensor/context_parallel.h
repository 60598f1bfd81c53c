// Context parallelism: each sequence cut across the C ranks of a cp group, so a rank's
// activations are 1/C of a long sequence's. Everything but attention works row by row and
// runs on a rank's rows as it would on the whole; attention needs every earlier key, and
// comes in three variants (torchtitan's context_parallel, Megatron-LM's CP, the Llama 3
// paper, DeepSpeed-Ulysses):
//
//   ring        key/value pieces travel round the group, C - 1 hops, while each rank
//               attends its queries to the piece it holds; the partial outputs merge by
//               their log-sum-exp (the online softmax):  lse = log(e^lse_a + e^lse_b),
//               out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b.
//               Backward sends the pieces round again, with their gradients beside them.
//   all_gather  every rank's keys and values gathered once a layer (small with grouped-
//               query attention), then the same blocks; backward gathers them again and
//               reduce-scatters their gradients.
//   ulysses     an all-to-all turns the sequence split into a head split (each rank all
//               S rows of H / C heads), plain attention, and an all-to-all back.
//
// Causal attention does less work for early queries, so the sequence is cut into 2C pieces
// and rank r holds pieces r and 2C - 1 - r (nn::load_balanced_pieces): every rank then
// computes 2C + 1 blocks of (query piece, key piece), 2 of them diagonal (context_schedule).
// Each variant gives a rank exactly its rows of the one-rank attention, and the one-rank
// gradients of its q, k and v.
#pragma once

#include <string_view>
#include <vector>

#include "dist/comm/process_group.h"
#include "nn/causal_lm.h"

namespace zg::dist {

enum class ContextVariant : uint8_t { ring, all_gather, ulysses };
const char* name(ContextVariant variant);               // "ring", "all_gather", "ulysses"
ContextVariant parse_context_variant(std::string_view);  // those names (or all-gather); else zg::Error

// x [.., S, ..] -> this rank's pieces along `dim` (rank `rank` of `ranks`, the load-balanced
// split), side by side: the tokens and targets a cp rank trains on. A zg::Error names a
// length that 2 x ranks does not divide.
Tensor context_shard(const Tensor& whole, int rank, int ranks, int64_t dim = 1);
// Its inverse over the group: every rank's pieces gathered into the whole [.., S, ..], in
// sequence order, on every rank (differentiable: the gradient is this rank's pieces').
Tensor context_unshard(const Tensor& pieces, ProcessGroup& group, int64_t dim = 1);

// One block of attention work: at ring `step`, query piece `query` (of 2C) attends to key
// piece `key`, which rank `source` holds; causal inside (diagonal) when they are the same
// piece, whole when the keys come first. Local slots 0 and 1 are a rank's first and second piece.
struct AttentionBlock {
  int step, source;
  int query_slot, key_slot;
  int query, key;
  bool diagonal;
};
// The blocks rank `rank` of `ranks` computes, in order: the ring's schedule, which the
// all_gather variant follows too (schedules as data).
std::vector<AttentionBlock> context_schedule(int rank, int ranks);

// Causal attention of this rank's pieces q [B, H, T, D] over k, v [B, H_kv, T, D] (H_kv
// dividing H: grouped-query), T = S / C: this rank's rows of the one-rank attention over
// the whole sequence. Differentiable. The group must outlive the backward. With dropout
// (p > 0), the probabilities drop as the one-rank op's would (its mask's part for this
// rank's heads): Ulysses only, whose ranks hold whole rows of the probabilities; the ring
// and the all-gather hold blocks of them, and refuse it.
Tensor context_attention(const Tensor& q, const Tensor& k, const Tensor& v, ProcessGroup& group,
                         ContextVariant variant, const nn::AttentionDropout& dropout = {});

// Cuts `model`'s sequences across `group` (C ranks): its attention modules (GPT's and
// Llama's) call context_attention, positions and dropout masks follow this rank's pieces,
// and forward(idx, targets) then takes context_shard(tokens) -- its loss is the mean over
// this rank's tokens; the mean of the ranks' is the whole sequence's, which averaging
// gradients over cp as over data parallelism (ShardedModel over a mesh with a cp
// dimension) trains on. Generation with a KV cache is refused, and attention dropout but
// by Ulysses; a variant that cannot divide the heads says so at the first forward. C = 1
// changes nothing.
void parallelize_context(nn::CausalLM& model, ProcessGroup& group, ContextVariant variant);

// Bytes one rank sends for one attention layer's forward and backward, each variant's
// formula (the group's bytes_sent counts the same). Pieces of B x T rows (T = S / C) with
// H query and H_kv key/value heads of D, `element` bytes each; gradients of keys and values
// travel in `accumulate` bytes (f32 for 16-bit models, else the model's).
//   ring:        fwd (C-1) kv;            bwd (C-1) kv + C dkv        kv = 2 B H_kv T D element
//   all_gather:  fwd (C-1) kv;            bwd (C-1) kv + (C-1) dkv    dkv = kv / element x accumulate
//   ulysses:     fwd (C-1)/C (q + k + v + out), bwd the same          q = out = B H T D element
struct ContextBytes {
  int64_t forward = 0, backward = 0;
};
ContextBytes context_attention_bytes(ContextVariant variant, int ranks, int64_t batch, int64_t rows, int64_t heads,
                                     int64_t kv_heads, int64_t head_dim, int64_t element, int64_t accumulate);

}  // namespace zg::dist
