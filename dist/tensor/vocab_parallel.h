// Megatron's vocabulary-parallel ends of a language model (Shoeybi et al. 2019, section
// 3; Megatron-LM's VocabParallelEmbedding and _VocabParallelCrossEntropy): the token
// embedding and the logits cut along the vocabulary V across a group of T ranks, rank r
// holding ids [r V/T, (r+1) V/T). Neither ever forms a [.., V] tensor on one rank.
#pragma once

#include "dist/comm/process_group.h"
#include "nn/module.h"

namespace zg::dist {

// out[..] = weight[token] for a token of this rank's range, 0 for the others, then summed
// over the ranks (reduce_from_group): each token's row comes from the one rank that
// holds it. weight [V/T, dim] is this rank's rows of the weight nn::Embedding(V, dim,
// init_std) draws from the same generator state. A token outside [0, V) is held by no
// rank and looks up zeros (nn::Embedding refuses it; checking here would read the host).
class VocabParallelEmbedding : public nn::Module {
 public:
  VocabParallelEmbedding(int64_t num_embeddings, int64_t embedding_dim, ProcessGroup& group, double init_std = 0.02,
                         TensorOptions options = {});
  Tensor forward(const Tensor& tokens) override;
  Tensor weight;        // [V/T, dim]
  int64_t vocab_start;  // this rank's first id, r V/T

 private:
  GroupRef group_;
};

// cross_entropy(logits, targets) of the full logits [N, V] = the ranks' logits_shard
// [N, V/T] side by side, from the shards: with m = max over all V (all-reduce max),
//   loss_i = log(sum over all V of exp(x_i - m)) - (x_i[target_i] - m)
// (the sum all-reduced, the target's logit from the rank that holds it, all-reduced),
// returned as the mean over the N rows (f32 for 16-bit logits, as cross_entropy); a target
// of -1 is ignored (cross_entropy's ignore_index), the mean taken over the other rows.
// Backward, with no communication: dx_i = (softmax_i - onehot(target_i)) / N on this
// rank's columns. targets [N] are global ids in [0, V) or -1, i32 or i64, alike on every rank
// (checked against V with one host read). One [N, V/T] buffer is made, forward and
// backward together: the softmax, then the gradient written over it (16-bit logits:
// also their f32 copy, during the forward).
Tensor vocab_parallel_cross_entropy(const Tensor& logits_shard, const Tensor& targets, ProcessGroup& group);

}  // namespace zg::dist
