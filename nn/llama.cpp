#include "nn/llama.h"

#include <cmath>
#include <numbers>

#include "nn/checkpoint.h"

namespace zg::nn {

void check_config(const LlamaConfig& c) {
  ZG_CHECK(c.n_layer > 0 && c.n_head > 0 && c.n_kv_head > 0 && c.n_embd > 0 && c.vocab_size > 0 && c.block_size > 0 &&
               c.intermediate_size >= 0,
           "Llama: every size in the config must be positive, got n_layer ", c.n_layer, ", n_head ", c.n_head,
           ", n_kv_head ", c.n_kv_head, ", n_embd ", c.n_embd, ", intermediate_size ", c.intermediate_size,
           ", vocab_size ", c.vocab_size, ", block_size ", c.block_size);
  ZG_CHECK(c.n_embd % c.n_head == 0 && (c.n_embd / c.n_head) % 2 == 0, "Llama: n_embd ", c.n_embd,
           " must be n_head (", c.n_head, ") times an even head size (rotary embeddings rotate pairs)");
  ZG_CHECK(c.n_head % c.n_kv_head == 0, "Llama: n_kv_head ", c.n_kv_head, " must divide n_head ", c.n_head);
  ZG_CHECK(c.rope_theta > 0 && c.norm_eps >= 0 && c.init_std >= 0, "Llama: expected rope_theta > 0, norm_eps >= 0 and ",
           "init_std >= 0, got ", c.rope_theta, ", ", c.norm_eps, ", ", c.init_std);
  const RopeScaling& s = c.rope_scaling;
  ZG_CHECK(s.factor > 0 && s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor &&
               s.original_max_position_embeddings > 0,
           "Llama: rope_scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and ",
           "original_max_position_embeddings > 0, got ", s.factor, ", ", s.low_freq_factor, ", ", s.high_freq_factor,
           ", ", s.original_max_position_embeddings);
}

int64_t intermediate_size(const LlamaConfig& c) {
  if (c.intermediate_size > 0) return c.intermediate_size;
  const int64_t two_thirds_of_4c = (8 * c.n_embd + 2) / 3;  // the 4C of a GELU MLP at the same parameter count
  return (two_thirds_of_4c + 63) / 64 * 64;
}

std::vector<double> rope_frequencies(const LlamaConfig& c) {
  const int64_t head_dim = c.n_embd / c.n_head;
  const RopeScaling& s = c.rope_scaling;
  std::vector<double> f(static_cast<size_t>(head_dim / 2));
  for (size_t i = 0; i < f.size(); ++i) {
    f[i] = std::pow(c.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
    if (s.type == RopeScaling::Type::linear) f[i] /= s.factor;
    if (s.type != RopeScaling::Type::llama3) continue;
    // Llama 3.1: wavelengths longer than the pretraining context / low_freq_factor are
    // stretched by factor, shorter than context / high_freq_factor kept; between them
    // f (1 - a) / factor + f a, with a = (context / wavelength - low) / (high - low).
    const double wavelength = 2 * std::numbers::pi / f[i];
    const double context = static_cast<double>(s.original_max_position_embeddings);
    const double a = (context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    if (wavelength > context / s.low_freq_factor) f[i] /= s.factor;
    else if (wavelength >= context / s.high_freq_factor) f[i] = (1 - a) * f[i] / s.factor + a * f[i];
  }
  return f;
}

const RotaryTables& RotaryCache::tables(int64_t length, TensorOptions options) {
  if (offset != made_offset_ || length != made_length_ || options.dtype() != made_dtype_ ||
      options.device() != made_device_ || pieces.parts != made_pieces_.parts || pieces.held != made_pieces_.held) {
    if (pieces.whole()) {
      tables_ = rotary_tables(offset, length, frequencies_, options);
    } else {  // piece h's rows sit at [h n, (h + 1) n) of the whole sequence
      const int64_t n = pieces.whole_length(length) / pieces.parts;
      std::vector<Tensor> cos, sin;
      for (int h : pieces.held) {
        const RotaryTables piece = rotary_tables(offset + h * n, n, frequencies_, options);
        cos.push_back(piece.cos), sin.push_back(piece.sin);
      }
      tables_ = {cat(cos, 0), cat(sin, 0)};
    }
    made_offset_ = offset, made_length_ = length, made_dtype_ = options.dtype(), made_device_ = options.device();
    made_pieces_ = pieces;
  }
  return tables_;
}

LlamaAttention::LlamaAttention(const LlamaConfig& config, std::shared_ptr<RotaryCache> rotary, TensorOptions options)
    : n_head(config.n_head), n_kv_head(config.n_kv_head), head_dim(config.n_embd / config.n_head),
      rotary_(std::move(rotary)) {
  check_config(config);
  const int64_t c = config.n_embd, kv = config.n_kv_head * head_dim;
  const bool qkv_bias = config.attention_bias || config.qkv_bias;
  q_proj = register_module("q_proj", std::make_shared<Linear>(c, c, qkv_bias, config.init_std, options));
  k_proj = register_module("k_proj", std::make_shared<Linear>(c, kv, qkv_bias, config.init_std, options));
  v_proj = register_module("v_proj", std::make_shared<Linear>(c, kv, qkv_bias, config.init_std, options));
  o_proj = register_module("o_proj", std::make_shared<Linear>(c, c, config.attention_bias, config.init_std, options));
}

Tensor LlamaAttention::forward(const Tensor& x) {
  ZG_CHECK(x.defined() && x.dim() == 3 && x.size(2) == q_proj->weight.size(1), "LlamaAttention: expected input [B, T, ",
           q_proj->weight.size(1), "], got ", describe(x));
  const int64_t batch = x.size(0), time = x.size(1);
  // [B, T, heads * D] -> [B, heads, T, D]; the head counts read from the projections, which
  // with tensor parallelism hold this rank's heads
  const auto heads = [&](const Tensor& t) { return t.view({batch, time, t.size(2) / head_dim, head_dim}).transpose(1, 2); };
  const RotaryTables& rope = rotary_->tables(time, TensorOptions(x.dtype()).device(x.device()));
  const Tensor q = rotary_embedding(heads((*q_proj)(x)), rope);
  const Tensor k = rotary_embedding(heads((*k_proj)(x)), rope);
  const Tensor v = heads((*v_proj)(x));
  const Tensor y = cache               ? cached_attention(*cache, q, k, v)
                   : context_attention ? context_attention(q, k, v, {})
                                       : scaled_dot_product_attention(q, k, v, /*causal=*/true);
  return (*o_proj)(y.transpose(1, 2).reshape({batch, time, q.size(1) * head_dim}));
}

LlamaBlock::LlamaBlock(const LlamaConfig& config, std::shared_ptr<RotaryCache> rotary, TensorOptions options) {
  check_config(config);
  input_layernorm = register_module("input_layernorm", std::make_shared<RMSNorm>(config.n_embd, config.norm_eps, options));
  self_attn = register_module("self_attn", std::make_shared<LlamaAttention>(config, std::move(rotary), options));
  post_attention_layernorm =
      register_module("post_attention_layernorm", std::make_shared<RMSNorm>(config.n_embd, config.norm_eps, options));
  mlp = register_module("mlp", std::make_shared<SwiGLU>(config.n_embd, intermediate_size(config), config.mlp_bias,
                                                        config.init_std, options));
}

Tensor LlamaBlock::forward(const Tensor& x) {
  const Tensor h = x + (*self_attn)((*input_layernorm)(x));
  return h + (*mlp)((*post_attention_layernorm)(h));
}

Llama::Llama(const LlamaConfig& cfg, TensorOptions options) : config(cfg) {
  check_config(config);
  rotary_ = std::make_shared<RotaryCache>(rope_frequencies(config));
  model = register_module("model", std::make_shared<Module>());
  embed_tokens = model->register_module(
      "embed_tokens", std::make_shared<Embedding>(config.vocab_size, config.n_embd, config.init_std, options));
  layers = model->register_module("layers", std::make_shared<ModuleList>());
  for (int64_t i = 0; i < config.n_layer; ++i) layers->push_back(std::make_shared<LlamaBlock>(config, rotary_, options));
  norm = model->register_module("norm", std::make_shared<RMSNorm>(config.n_embd, config.norm_eps, options));
  if (!config.tie_embeddings)
    lm_head = register_module("lm_head", std::make_shared<Linear>(config.n_embd, config.vocab_size, false,
                                                                  config.init_std, options));
}

Tensor Llama::logits(const Tensor& idx, KVCache* cache) {
  const int64_t offset = cache ? cache->length() : 0;
  std::vector<LlamaAttention*> attentions;
  for (size_t i = 0; i < layers->size(); ++i) attentions.push_back(layers->at<LlamaBlock>(i).self_attn.get());
  const KVCacheBinding binding(attentions, cache);
  set_position_offset(offset);
  Tensor x = (*embed_tokens)(idx);
  for (size_t i = 0; i < layers->size(); ++i) {
    Module& block = (*layers)[i];
    if (config.activation_checkpointing && cache == nullptr)
      x = checkpoint([&block](const std::vector<Tensor>& in) { return block(in[0]); }, {x});
    else x = block(x);
  }
  x = (*norm)(x);
  if (lm_head) return (*lm_head)(x);
  return matmul(x.reshape({-1, config.n_embd}), embed_tokens->weight, false, true)
      .view({idx.size(0), idx.size(1), embed_tokens->weight.size(0)});
}

// Megatron's cut: q, k, v by heads (grouped-query: k and v by key/value heads, so n_kv_head
// must divide too), o_proj by its input; the SwiGLU's gate and up by hidden features,
// down_proj by its input; the vocabulary. Each norm's output enters the colwise layers
// after it once (copy_output): one all-reduce in backward for q, k and v together (with
// sequence parallelism, one all-gather of the norm's sequence shards).
ParallelPlan Llama::parallel_plan() const {
  using enum ParallelStyle;
  ParallelPlan plan{.rules = {{"model.embed_tokens", vocab_embedding},
                              {"model.layers.0", scatter_input},
                              {"model.layers.*.input_layernorm", copy_output},
                              {"model.layers.*.self_attn.[qkv]_proj", colwise, 1, /*copy_input=*/false},
                              {"model.layers.*.self_attn.o_proj", rowwise},
                              {"model.layers.*.post_attention_layernorm", copy_output},
                              {"model.layers.*.mlp.gate_proj", colwise, 1, /*copy_input=*/false},
                              {"model.layers.*.mlp.up_proj", colwise, 1, /*copy_input=*/false},
                              {"model.layers.*.mlp.down_proj", rowwise}},
                    .must_divide = {{"n_head", config.n_head}, {"n_kv_head", config.n_kv_head},
                                    {"vocab_size", config.vocab_size}},
                    .vocab_parallel_logits = true};
  if (lm_head) plan.rules.insert(plan.rules.end(), {{"model.norm", sequence_norm}, {"lm_head", colwise}});
  else plan.rules.push_back({"model.norm", copy_output});
  return plan;
}

UnitPlan Llama::unit_plan() const {
  UnitPlan plan;
  for (int64_t i = 0; i < config.n_layer; ++i) plan.units.push_back("model.layers." + std::to_string(i));
  plan.root_before = {"model.embed_tokens"};
  plan.root_after = {"model.norm"};
  if (lm_head) plan.root_after.push_back("lm_head");
  plan.backward_reads_no_weights = plan.root_before;
  return plan;
}

}  // namespace zg::nn
