// What a causal language model is to its callers -- GPT and Llama alike: token ids in,
// next-token logits out; with targets, the loss; with a KV cache, one step of generation
// (nn/generate.h takes any CausalLM). A model supplies logits() and its block_size.
#pragma once

#include <functional>
#include <optional>

#include "nn/kv_cache.h"
#include "nn/module.h"
#include "nn/sequence_pieces.h"

namespace zg::nn {

// Keep only the loss for backward where the logits are not needed (`Tensor loss =
// model.forward(x, y).loss;`, then `loss.backward()`): cross_entropy's backward then
// writes the gradient over the logits, and no second [B, T, vocab] buffer is made. An
// output held through backward (`model.forward(x, y).loss.backward()` holds its
// temporary until the call returns) keeps its logits, and backward allocates.
struct CausalLMOutput {
  Tensor logits;  // [B, T, vocab] (cut along the vocabulary: this rank's [B, T, vocab / T])
  Tensor loss;    // mean cross-entropy over targets != -1; undefined without targets
};
using GPTOutput = CausalLMOutput;

class CausalLM : public Module {
 public:
  // idx [B, T] token ids (i32/i64); targets [B, T] or undefined; a target of -1 is ignored.
  CausalLMOutput forward(const Tensor& idx, const Tensor& targets);
  // The logits [B, T, vocab] of idx following the cache's tokens, which idx joins
  // (nn/kv_cache.h: a prompt, then one token a call). For generation (nn/generate.h).
  Tensor forward(const Tensor& idx, KVCache& cache);
  // The mean cross-entropy of logits [B, T, V] -- or, cut along the vocabulary, this rank's
  // shard [B, T, V/T] -- against targets [B, T], as forward(idx, targets) computes its loss
  // (a pipeline's last stage calls it on the logits it made).
  Tensor loss(const Tensor& logits, const Tensor& targets) const;
  virtual int64_t block_size() const = 0;  // the longest sequence (cache included) it takes
  int64_t num_parameters() const;           // elements, a shared (tied) parameter once

  // Set by dist::parallelize_module when the head is cut along the vocabulary: logits()
  // make this rank's shard [B, T, V/T], which forward(idx, targets) returns as its logits,
  // its loss computed from the shards (never a [B, T, V] tensor); forward(idx, cache)
  // gathers the whole [B, T, V] for generation.
  struct VocabShards {
    std::function<Tensor(const Tensor& logits, const Tensor& targets)> cross_entropy;  // [N, V/T], [N]
    std::function<Tensor(const Tensor& logits)> gather;                                 // [.., V/T] -> [.., V]
  };
  void set_vocab_shards(VocabShards shards) { vocab_shards_ = std::move(shards); }

  // Set by dist::parallelize_context: idx [B, T] holds this rank's pieces of each sequence
  // of T x parts / held.size() tokens (and targets the same pieces), the positions read from
  // them. Generation with a KV cache is then refused. Whole (the default): one rank's model.
  void set_sequence_pieces(SequencePieces pieces) { sequence_pieces_ = std::move(pieces); }
  const SequencePieces& sequence_pieces() const { return sequence_pieces_; }
  // The positions of idx's T tokens (after the cache's `offset` tokens), i64 on `device`.
  Tensor positions(int64_t length, int64_t offset, Device device) const;

 protected:
  // The logits of idx, after the cache's tokens when there is a cache. Called by forward()
  // once check_tokens() has accepted idx.
  virtual Tensor logits(const Tensor& idx, KVCache* cache) = 0;

 private:
  void check_tokens(const Tensor& idx, const KVCache* cache) const;
  std::optional<VocabShards> vocab_shards_;
  SequencePieces sequence_pieces_;
};

// Dropout on attention probabilities, in training: p, and which part of the one-rank
// model's heads a rank's q holds (part `head_part` of `head_parts`: tensor parallelism's
// cut), so that its mask is that part of the one-rank mask.
struct AttentionDropout {
  double p = 0;
  int head_part = 0, head_parts = 1;
};

// Causal attention of q [B, H, T, D] over k, v [B, H_kv, T, D] (H_kv dividing H) computed
// otherwise than by zg::scaled_dot_product_attention: by the ranks of a context-parallel
// group, each holding pieces of the sequence (dist/tensor/context_parallel.h). An attention
// module with one set calls it in place of the one-rank op.
using CausalAttention =
    std::function<Tensor(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionDropout& dropout)>;

}  // namespace zg::nn
