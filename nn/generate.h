// Text generation for the causal language models (nn::CausalLM: GPT, Llama): the prompt's forward fills
// a KV cache (nn/kv_cache.h), then each new token is one forward of one position. The next
// token is drawn on the host from the last position's logits, with the rank's generator
// (manual_seed): a seed gives the same text every time.
#pragma once

#include "nn/causal_lm.h"

namespace zg::nn {

struct SamplingOptions {
  double temperature = 1.0;  // logits / temperature; 0: greedy (the most likely token)
  int64_t top_k = 0;         // > 0: only the k most likely tokens
  double top_p = 1.0;        // < 1: only the fewest most likely tokens whose probabilities sum to top_p (nucleus)
};

// The next token of each row of logits [B, V], as i64 [B, 1] on the logits' device.
Tensor sample(const Tensor& logits, const SamplingOptions& options = {});

// prompt [B, T0] (i64) followed by max_new_tokens sampled tokens: [B, T0 + max_new_tokens].
// The model runs in eval mode without gradients (its mode is restored). Past its
// block_size, each token is predicted from the block_size tokens before it (a sliding
// window, as nanoGPT's generate; the cache is then refilled each step).
Tensor generate(CausalLM& model, const Tensor& prompt, int64_t max_new_tokens, const SamplingOptions& options = {});

}  // namespace zg::nn
