// Hugging Face GPT-2 weights in and out: the safetensors file of a GPT2LMHeadModel
// (save_pretrained's model.safetensors, names "transformer.h.0.attn.c_attn.weight", ...)
// or of a GPT2Model (the Hub's openai-community/gpt2 file, the same names without
// "transformer."). Their attention and MLP layers are Conv1D, weights stored [in, out]
// where nn::Linear keeps [out, in]: each is transposed on the way in and out. The LM head
// is tied to wte, so a file's lm_head.weight must equal its wte (it is read as wte when the
// file has no wte); the attention-mask buffers of older files (attn.bias, attn.masked_bias)
// are skipped.
#pragma once

#include <string>

#include "nn/gpt.h"

namespace zg::nn {

// The config a file's shapes give: n_layer (the h.<i> present), n_embd and vocab_size
// (wte), block_size (wpe). The head count is not in the weights: n_head is read from a
// config.json beside the file (save_pretrained writes one) when there is one, else taken
// from `n_head` (0 then is an error). The dropout is the config.json's embd_pdrop,
// attn_pdrop and resid_pdrop (0.1 each where not given, as transformers), which must be
// equal: nn::GPT has one dropout for the three places; without a config.json it is 0.
GPTConfig hf_gpt2_config(const std::string& path, int64_t n_head = 0);

// The config of a GPT-2 config.json alone (or of the one in a save_pretrained folder), read
// strictly as hf_llama_config reads a Llama's: n_layer, n_head, n_embd, vocab_size and
// n_positions (-> block_size) required; n_ctx = n_positions, n_inner null or 4 n_embd,
// activation_function "gelu_new" (or "gelu_pytorch_tanh", the same function),
// layer_norm_epsilon 1e-5, scale_attn_weights true, scale_attn_by_inverse_layer_idx,
// add_cross_attention false, tie_word_embeddings true; the three dropouts equal (-> dropout);
// reorder_and_upcast_attn and initializer_range have no effect on the function. Ignored:
// token ids, architectures (checked: GPT2LMHeadModel or GPT2Model), dtype, the summary_*
// keys (GPT2DoubleHeadsModel's classifier), task_specific_params, transformers_version,
// use_cache. Any other key is refused by name.
GPTConfig hf_gpt2_config_json(const std::string& path);

// Loads every parameter of `model` from the file (strict: a missing or unexpected tensor,
// or a shape that does not fit, is an error naming it; nothing is written unless all fit).
// Load before a ShardedModel takes the parameters, as nn::load_state.
void load_hf_gpt2(GPT& model, const std::string& path);

// Writes a file GPT2LMHeadModel.from_pretrained reads (with a config.json of the same
// shape): "transformer."-prefixed names, Conv1D layout, f32, no lm_head.weight (tied).
void save_hf_gpt2(const GPT& model, const std::string& path);

}  // namespace zg::nn
