// A Llama-family decoder (Touvron et al. 2023), laid out like Hugging Face's
// LlamaForCausalLM so parameter names match: model.embed_tokens, model.layers.<i>
// (input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
// mlp.{gate,up,down}_proj), model.norm, lm_head. Pre-norm blocks with RMSNorm, rotary
// position embeddings on q and k, grouped-query attention (n_kv_head key/value heads
// shared by n_head query heads), a SwiGLU MLP, no biases unless the config asks for them
// (Llama's attention_bias and mlp_bias, Qwen2's q, k and v biases). nn/hf_llama.h reads
// and writes Hugging Face's config.json and weights.
#pragma once

#include <memory>
#include <vector>

#include "nn/gpt.h"

namespace zg::nn {

// Hugging Face's rope_scaling: the rotary frequencies adjusted for contexts longer than
// the model was pretrained on (see rope_frequencies).
struct RopeScaling {
  enum class Type : uint8_t { none, linear, llama3 };
  Type type = Type::none;
  double factor = 1;
  double low_freq_factor = 1, high_freq_factor = 4;  // llama3 only
  int64_t original_max_position_embeddings = 8192;   // llama3 only
};

struct LlamaConfig {
  int64_t n_layer = 2;
  int64_t n_head = 4;
  int64_t n_kv_head = 2;   // divides n_head; = n_head is plain multi-head attention
  int64_t n_embd = 64;
  int64_t intermediate_size = 0;  // the SwiGLU's hidden size; 0: 8/3 n_embd rounded up to a multiple of 64
  int64_t vocab_size = 256;
  int64_t block_size = 256;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  bool tie_embeddings = false;  // lm_head reads embed_tokens' weight
  double init_std = 0.02;       // N(0, init_std) for every Linear and the embedding (HF's initializer_range)
  bool activation_checkpointing = false;  // recompute each block's activations in backward
  RopeScaling rope_scaling = {};
  bool attention_bias = false;  // q, k, v and o_proj biased (HF Llama's attention_bias)
  bool qkv_bias = false;        // q, k and v biased, o_proj not (Qwen2)
  bool mlp_bias = false;        // gate, up and down_proj biased
};
// Throws zg::Error unless the sizes are positive, n_embd = n_head * head size with an even
// head size, n_kv_head divides n_head, and the rope scaling's factors are positive (llama3:
// high_freq_factor > low_freq_factor).
void check_config(const LlamaConfig& config);
int64_t intermediate_size(const LlamaConfig& config);  // the SwiGLU's hidden size, 0 resolved
// The D/2 rotary frequencies f_i = rope_theta^(-2i/D) of a head of size D, scaled: linear
// divides each by factor (positions / factor); llama3 (transformers' _compute_llama3_parameters)
// divides those of wavelength 2 pi / f above original / low_freq_factor by factor, keeps
// those below original / high_freq_factor, and blends the ones between (see the .cpp).
std::vector<double> rope_frequencies(const LlamaConfig& config);

// The positions one forward rotates q and k to: tables made once per (offset, length,
// pieces) and shared by every layer. The model sets `offset` (a KV cache's length) and
// `pieces` (a context-parallel rank's pieces of the sequence) before its blocks run.
class RotaryCache {
 public:
  explicit RotaryCache(std::vector<double> frequencies) : frequencies_(std::move(frequencies)) {}
  const RotaryTables& tables(int64_t length, TensorOptions options);
  int64_t offset = 0;
  SequencePieces pieces;

 private:
  std::vector<double> frequencies_;  // rope_frequencies
  int64_t made_offset_ = -1, made_length_ = -1;
  SequencePieces made_pieces_;
  DType made_dtype_ = DType::f32;
  Device made_device_ = kCPU;
  RotaryTables tables_;
};

// softmax(rope(q) rope(k)^T / sqrt(d)) v, causal, with n_kv_head heads for k and v.
class LlamaAttention : public Module {
 public:
  LlamaAttention(const LlamaConfig& config, std::shared_ptr<RotaryCache> rotary, TensorOptions options);
  Tensor forward(const Tensor& x) override;  // [B, T, C] -> [B, T, C]
  std::shared_ptr<Linear> q_proj, k_proj, v_proj, o_proj;
  int64_t n_head, n_kv_head, head_dim;
  KVCache::Layer* cache = nullptr;  // set by Llama::forward(idx, cache) while it runs
  CausalAttention context_attention;  // set by dist::parallelize_context

 private:
  std::shared_ptr<RotaryCache> rotary_;
};

// h = x + self_attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h)).
class LlamaBlock : public Module {
 public:
  LlamaBlock(const LlamaConfig& config, std::shared_ptr<RotaryCache> rotary, TensorOptions options);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<RMSNorm> input_layernorm, post_attention_layernorm;
  std::shared_ptr<LlamaAttention> self_attn;
  std::shared_ptr<SwiGLU> mlp;
};

class Llama : public CausalLM {
 public:
  explicit Llama(const LlamaConfig& config, TensorOptions options = {});
  using CausalLM::forward;  // (idx, targets) -> logits and loss; (idx, cache) -> logits
  int64_t block_size() const override { return config.block_size; }
  // Units model.layers.0 ... ; the root (embed_tokens; norm and lm_head) around them.
  UnitPlan unit_plan() const override;
  // Heads (query and key/value), SwiGLU features and the vocabulary cut across a
  // tensor-parallel group.
  ParallelPlan parallel_plan() const override;
  // Where the next forward's rotary positions start: logits() sets it from its cache; a
  // pipeline stage, running some layers alone, sets 0. (A context-parallel rank's positions
  // are its pieces', sequence_pieces.)
  void set_position_offset(int64_t offset) {
    rotary_->offset = offset;
    rotary_->pieces = sequence_pieces();
  }

  LlamaConfig config;
  std::shared_ptr<Module> model;
  std::shared_ptr<Embedding> embed_tokens;
  std::shared_ptr<ModuleList> layers;
  std::shared_ptr<RMSNorm> norm;
  std::shared_ptr<Linear> lm_head;  // null when tied

 protected:
  Tensor logits(const Tensor& idx, KVCache* cache) override;

 private:
  std::shared_ptr<RotaryCache> rotary_;
};

}  // namespace zg::nn
