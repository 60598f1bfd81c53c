#include "nn/gpt.h"

#include <cmath>

#include "nn/checkpoint.h"

namespace zg::nn {

void check_config(const GPTConfig& c) {
  ZG_CHECK(c.n_layer > 0 && c.n_head > 0 && c.n_embd > 0 && c.vocab_size > 0 && c.block_size > 0,
           "GPT: every size in the config must be positive, got n_layer ", c.n_layer, ", n_head ", c.n_head,
           ", n_embd ", c.n_embd, ", vocab_size ", c.vocab_size, ", block_size ", c.block_size);
  ZG_CHECK(c.n_embd % c.n_head == 0, "GPT: n_embd ", c.n_embd, " is not a multiple of n_head ", c.n_head);
  ZG_CHECK(c.n_embd <= INT64_MAX / 4, "GPT: n_embd ", c.n_embd, " is too large (4 n_embd overflows int64)");
  ZG_CHECK(c.dropout >= 0 && c.dropout < 1, "GPT: dropout must be in [0, 1), got ", c.dropout);
}

CausalSelfAttention::CausalSelfAttention(const GPTConfig& config, TensorOptions options)
    : n_head(config.n_head), attn_dropout(config.dropout) {
  check_config(config);
  const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config.n_layer));
  c_attn = register_module("c_attn", std::make_shared<Linear>(config.n_embd, 3 * config.n_embd, true, 0.02, options));
  c_proj = register_module("c_proj", std::make_shared<Linear>(config.n_embd, config.n_embd, true, proj_std, options));
  resid_dropout = register_module("resid_dropout", std::make_shared<Dropout>(config.dropout));
}

// With tensor parallelism c_attn holds this rank's heads of q, k and v: the head count is
// read from its weight ([3 H_r D, C]), so one forward serves any number of ranks.
Tensor CausalSelfAttention::forward(const Tensor& x) {
  ZG_CHECK(x.defined() && x.dim() == 3 && x.size(2) == c_attn->weight.size(1), "CausalSelfAttention: expected input [B, T, ",
           c_attn->weight.size(1), "], got ", describe(x));
  const int64_t head_dim = x.size(2) / n_head, local_heads = c_attn->weight.size(0) / (3 * head_dim);
  const bool drops = is_training() && attn_dropout > 0;
  if (cache == nullptr && !drops && !context_attention) {
    // qkv [B, T, 3C] -> the heads' attention, side by side [B, T, C] (q, k, v read in place);
    // a statement of its own, so qkv is freed before c_proj runs where backward keeps nothing
    const Tensor y = packed_attention((*c_attn)(x), local_heads, /*causal=*/true);
    return (*resid_dropout)((*c_proj)(y));
  }
  const Tensor qkv = (*c_attn)(x);  // [B, T, 3 H_r D]: the whole sequence, also where x is a sequence shard
  const int64_t batch = qkv.size(0), time = qkv.size(1), channels = local_heads * head_dim;
  std::vector<Tensor> heads;  // q, k, v as [B, H, T, D]
  for (const Tensor& part : split(qkv, channels, 2))
    heads.push_back(part.view({batch, time, local_heads, head_dim}).transpose(1, 2));
  // With the heads cut, this rank's are part `part` of the whole attention's: its
  // probabilities drop with that part of the one-rank mask.
  int part = 0, parts = 1;
  for (const auto& [name, split] : c_attn->named_splits())
    if (name == "weight") part = split.part, parts = split.parts;
  const Tensor y = cache               ? cached_attention(*cache, heads[0], heads[1], heads[2])
                   : context_attention ? context_attention(heads[0], heads[1], heads[2], {drops ? attn_dropout : 0, part, parts})
                                       : scaled_dot_product_attention(heads[0], heads[1], heads[2], true, attn_dropout,
                                                                      true, part, parts);
  return (*resid_dropout)((*c_proj)(y.transpose(1, 2).reshape({batch, time, channels})));
}

MLP::MLP(const GPTConfig& config, TensorOptions options) {
  check_config(config);
  const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config.n_layer));
  // c_fc applies GPT-2's GELU itself when called alone (a GEMM epilogue on CUDA).
  c_fc = register_module("c_fc", std::make_shared<Linear>(config.n_embd, 4 * config.n_embd, true, 0.02, options,
                                                          Activation::gelu));
  c_proj = register_module("c_proj", std::make_shared<Linear>(4 * config.n_embd, config.n_embd, true, proj_std, options));
  dropout = register_module("dropout", std::make_shared<Dropout>(config.dropout));
}

// c_proj(gelu(c_fc(x))) as one op (zg::mlp) through the two layers' weights: the GELU
// output is made again in backward rather than kept. Cut by dist::parallelize_module
// (its split recorded), through the layers, whose hooks carry the collectives; the GELU
// output is kept then.
Tensor MLP::forward(const Tensor& x) {
  if (!c_fc->named_splits().empty()) return (*dropout)((*c_proj)((*c_fc)(x)));
  return (*dropout)(mlp(x, c_fc->weight, c_fc->bias, c_proj->weight, c_proj->bias));
}

Block::Block(const GPTConfig& config, TensorOptions options) {
  check_config(config);
  ln_1 = register_module("ln_1", std::make_shared<LayerNorm>(config.n_embd, 1e-5, true, options));
  attn = register_module("attn", std::make_shared<CausalSelfAttention>(config, options));
  ln_2 = register_module("ln_2", std::make_shared<LayerNorm>(config.n_embd, 1e-5, true, options));
  mlp = register_module("mlp", std::make_shared<MLP>(config, options));
}

// h = x + attn(ln_1(x)); out = h + mlp(ln_2(h)). The first residual add and ln_2 are one
// kernel (add_layer_norm), so ln_2 runs through its weights here rather than its forward.
Tensor Block::forward(const Tensor& x) {
  const AddLayerNormOutput h = add_layer_norm(x, (*attn)((*ln_1)(x)), ln_2->weight, ln_2->bias, ln_2->eps);
  return h.sum + (*mlp)(h.out);
}

GPT::GPT(const GPTConfig& cfg, TensorOptions options) : config(cfg) {
  check_config(config);
  transformer = register_module("transformer", std::make_shared<Module>());
  wte = transformer->register_module("wte", std::make_shared<Embedding>(config.vocab_size, config.n_embd, 0.02, options));
  wpe = transformer->register_module("wpe", std::make_shared<Embedding>(config.block_size, config.n_embd, 0.02, options));
  h = transformer->register_module("h", std::make_shared<ModuleList>());
  for (int64_t i = 0; i < config.n_layer; ++i) h->push_back(std::make_shared<Block>(config, options));
  ln_f = transformer->register_module("ln_f", std::make_shared<LayerNorm>(config.n_embd, 1e-5, true, options));
  lm_head = register_module("lm_head", std::make_shared<Module>());
  lm_head->register_parameter("weight", wte->weight);  // tied: the same tensor
}

Tensor GPT::logits(const Tensor& idx, KVCache* cache) {
  const int64_t time = idx.size(1), offset = cache ? cache->length() : 0;
  std::vector<CausalSelfAttention*> attentions;
  for (size_t i = 0; i < h->size(); ++i) attentions.push_back(h->at<Block>(i).attn.get());
  const KVCacheBinding binding(attentions, cache);
  Tensor x = embed(idx, offset);
  for (size_t i = 0; i < h->size(); ++i) {
    Module& block = (*h)[i];
    if (config.activation_checkpointing && cache == nullptr)
      x = checkpoint([&block](const std::vector<Tensor>& in) { return block(in[0]); }, {x});
    else x = block(x);
  }
  x = (*ln_f)(x);
  // The LM head is the token embedding, transposed (weight tying; lm_head.weight is wte's).
  return matmul(x.reshape({-1, config.n_embd}), wte->weight, false, true).view({idx.size(0), time, wte->weight.size(0)});
}

Tensor GPT::embed(const Tensor& idx, int64_t offset) {
  const Tensor x = (*wte)(idx) + (*wpe)(positions(idx.size(1), offset, idx.device()));
  const SequencePieces& pieces = sequence_pieces();
  return pieces.whole() ? dropout(x, config.dropout, is_training())
                        : dropout_pieces(x, config.dropout, is_training(), 1, pieces.held, pieces.parts, "GPT");
}

// Megatron's cut: heads of q, k and v (c_attn as three blocks), the MLP's hidden features,
// and the vocabulary (the tied wte, so the head's logits are vocabulary shards, ln_f's
// output entering them). With sequence parallelism the blocks run on sequence shards from
// h.0 on, their norms' weights gathering gradient from every rank.
ParallelPlan GPT::parallel_plan() const {
  using enum ParallelStyle;
  return {.rules = {{"transformer.wte", vocab_embedding},
                    {"transformer.h.0", scatter_input},
                    {"transformer.h.*.ln_[12]", sequence_norm},
                    {"transformer.h.*.attn.c_attn", colwise, /*chunks=*/3},
                    {"transformer.h.*.attn.c_proj", rowwise},
                    {"transformer.h.*.mlp.c_fc", colwise},
                    {"transformer.h.*.mlp.c_proj", rowwise},
                    {"transformer.h.*.attn.resid_dropout", sequence_dropout},
                    {"transformer.h.*.mlp.dropout", sequence_dropout},
                    {"transformer.ln_f", copy_output}},
          .must_divide = {{"n_head", config.n_head}, {"vocab_size", config.vocab_size}},
          .vocab_parallel_logits = true};
}

UnitPlan GPT::unit_plan() const {
  UnitPlan plan;
  for (int64_t i = 0; i < config.n_layer; ++i) plan.units.push_back("transformer.h." + std::to_string(i));
  plan.root_before = {"transformer.wte", "transformer.wpe"};
  plan.root_after = {"transformer.ln_f"};
  plan.backward_reads_no_weights = plan.root_before;  // embeddings: a scatter-add
  return plan;
}

}  // namespace zg::nn
