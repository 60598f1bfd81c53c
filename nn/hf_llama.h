// Hugging Face Llama-family checkpoints in and out: a save_pretrained folder of a
// LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM -- config.json, and the weights
// as model.safetensors or shards named by model.safetensors.index.json (nn/hf_weights.h) --
// read into an nn::Llama, whose parameter names are theirs, and written back.
//
// config.json, strictly: every key below is read and checked, and a value the model cannot
// honour is a zg::Error naming the key, the value and the file, never a silent default.
//   required   hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
//              vocab_size, max_position_embeddings (-> block_size), rms_norm_eps (-> norm_eps),
//              rope_theta (4.x) or rope_parameters.rope_theta (transformers 5)
//   optional   num_key_value_heads (num_attention_heads), head_dim (must be hidden_size /
//              num_attention_heads), tie_word_embeddings (false), initializer_range (-> init_std,
//              0.02), hidden_act ("silu" only), attention_dropout (0 only), rope_scaling (4.x) or
//              rope_parameters (5): rope_type "default", "linear" (factor) or "llama3" (factor,
//              low_freq_factor, high_freq_factor, original_max_position_embeddings, which is
//              max_position_embeddings when absent); partial_rotary_factor 1 only
//   llama      attention_bias (q, k, v, o), mlp_bias (false), pretraining_tp (1 only)
//   mistral    sliding_window (4096 when absent, as MistralConfig): null or >= max_position_embeddings
//   qwen2      q, k and v biased (o not); use_sliding_window (false), sliding_window,
//              max_window_layers, layer_types: a window in use must be >= max_position_embeddings
//   ignored    (no effect on the forward pass) _name_or_path, architectures (checked to be
//              the model_type's CausalLM), bos_token_id, dtype, eos_token_id, model_type
//              (checked), pad_token_id, torch_dtype, transformers_version, use_cache
// Any other key is refused by name: it may change the model (quantization_config, ...).
#pragma once

#include <cstdint>
#include <string>

#include "nn/llama.h"

namespace zg::nn {

// The config of a config.json, or of the one in a save_pretrained folder.
LlamaConfig hf_llama_config(const std::string& path);

// The config.json save_hf_llama writes: model_type "llama" (LlamaForCausalLM), or "qwen2"
// for a model whose q, k and v alone are biased; rope_theta and rope_scaling as transformers
// 4.x writes them (5.x reads them too). `dtype` names the weights' ("float32", ...).
std::string hf_llama_config_json(const LlamaConfig& config, const std::string& dtype = "float32");

// Loads every parameter of `model` from a save_pretrained folder or one .safetensors file.
// Strict: a missing or unexpected tensor, or a shape that does not fit, is an error naming
// it, and nothing is written unless everything fits. A tied model takes a file's
// lm_head.weight only if it equals embed_tokens; older files' rotary_emb.inv_freq buffers
// are skipped. Stored f32, bf16 and f16 convert to the model's dtype. Load before a
// ShardedModel takes the parameters, as nn::load_state.
void load_hf_llama(Llama& model, const std::string& path);

// Writes `folder` so that AutoModelForCausalLM.from_pretrained reads back the same model:
// config.json, and the parameters in their dtype as model.safetensors, or as shards of at
// most max_shard_bytes and the index (transformers 4.x's 5 GB default). Every file is
// written atomically.
void save_hf_llama(const Llama& model, const std::string& folder, int64_t max_shard_bytes = 5'000'000'000);

}  // namespace zg::nn
