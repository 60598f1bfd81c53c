// A GPT-2 model (Radford et al. 2019), laid out like Hugging Face's GPT2LMHeadModel
// so parameter names match: transformer.wte, transformer.wpe, transformer.h.<i>
// (ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj), transformer.ln_f.
// The LM head shares the token embedding's weight (tied), as in GPT-2; `lm_head.weight`
// names it too, so state dicts that list it (torch's state_dict of nanoGPT's or
// transformers' GPT-2) load strictly through nn::load_state.
#pragma once

#include <memory>

#include "nn/causal_lm.h"
#include "nn/layers.h"

namespace zg::nn {

struct GPTConfig {
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_embd = 768;
  int64_t vocab_size = 50257;
  int64_t block_size = 1024;
  double dropout = 0.0;  // on the embeddings, the attention probabilities and each residual branch (nanoGPT's)
  bool activation_checkpointing = false;  // recompute each block's activations in backward
};
// Throws zg::Error unless every size is positive, n_embd is a multiple of n_head, the
// widest layer (4 n_embd) and the c_attn projection (3 n_embd) fit in int64, and dropout
// lies in [0, 1). Every module built from a config checks it.
void check_config(const GPTConfig& config);

// softmax(q k^T / sqrt(d)) v per head, causal; q, k, v from one projection c_attn.
class CausalSelfAttention : public Module {
 public:
  CausalSelfAttention(const GPTConfig& config, TensorOptions options);
  Tensor forward(const Tensor& x) override;  // [B, T, C] -> [B, T, C]
  std::shared_ptr<Linear> c_attn, c_proj;
  std::shared_ptr<Dropout> resid_dropout;
  int64_t n_head;
  double attn_dropout;  // on the attention probabilities in training (composed: no fused kernel then)
  KVCache::Layer* cache = nullptr;  // set by GPT::forward(idx, cache) while it runs
  CausalAttention context_attention;  // set by dist::parallelize_context
};

// c_proj(gelu(c_fc(x))), hidden size 4C, as one op (zg::mlp: the GELU output is made
// again in backward, not kept).
class MLP : public Module {
 public:
  MLP(const GPTConfig& config, TensorOptions options);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Linear> c_fc, c_proj;
  std::shared_ptr<Dropout> dropout;
};

// Pre-norm residual block: h = x + attn(ln_1(x)); out = h + mlp(ln_2(h)).
class Block : public Module {
 public:
  Block(const GPTConfig& config, TensorOptions options);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<LayerNorm> ln_1, ln_2;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<MLP> mlp;
};

class GPT : public CausalLM {
 public:
  // Parameters are created with `options` (dtype and device) and GPT-2's initialisation:
  // N(0, 0.02) weights, zero biases, unit norms, and N(0, 0.02 / sqrt(2 n_layer)) for the
  // projections that write into the residual stream.
  explicit GPT(const GPTConfig& config, TensorOptions options = {});
  using CausalLM::forward;  // (idx, targets) -> logits and loss; (idx, cache) -> logits
  int64_t block_size() const override { return config.block_size; }
  // Units transformer.h.0 ... h.{n_layer-1}; the root (tied embedding and head, wpe,
  // ln_f) used by wte and wpe before the blocks and by ln_f (and the head) after them.
  UnitPlan unit_plan() const override;
  // The blocks' input: wte(idx) + wpe(positions), dropped; positions after the cache's
  // `offset` tokens, or a context-parallel rank's (sequence_pieces). A pipeline's first stage runs it.
  Tensor embed(const Tensor& idx, int64_t offset = 0);
  // Heads, MLP features and the vocabulary cut across a tensor-parallel group.
  ParallelPlan parallel_plan() const override;

  GPTConfig config;
  std::shared_ptr<Module> transformer;
  std::shared_ptr<Embedding> wte, wpe;
  std::shared_ptr<ModuleList> h;
  std::shared_ptr<LayerNorm> ln_f;
  // Holds one parameter, "weight": wte's weight, under the head's name (not a second tensor;
  // named_parameters() lists it once, as transformer.wte.weight).
  std::shared_ptr<Module> lm_head;

 protected:
  Tensor logits(const Tensor& idx, KVCache* cache) override;
};

}  // namespace zg::nn
