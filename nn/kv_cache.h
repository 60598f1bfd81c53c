// A KV cache for generation: each attention layer's keys and values of the tokens seen so
// far ([B, H_kv, S, D]), so a new token's forward computes one row of attention instead of
// the whole sequence again. Filled by a model's forward(idx, cache): the prompt first (its
// tokens attend causally), then one token a call (it attends to everything cached).
#pragma once

#include <utility>
#include <vector>

#include "tensor/tensor.h"

namespace zg::nn {

struct KVCache {
  struct Layer {
    Tensor keys, values;  // [B, H_kv, S, D]: the first S positions of the buffers below (after the prompt)
    // Room for the tokens to come, grown geometrically so that a token's step copies its own
    // keys and values, not the whole cache (a cat a token would copy O(S^2) bytes in all).
    Tensor key_buffer, value_buffer;
  };
  std::vector<Layer> layers;

  int64_t length() const { return layers.empty() || !layers[0].keys.defined() ? 0 : layers[0].keys.size(2); }
  void clear() { layers.clear(); }
};

// Attention of q [B, H, T, D] over the layer's cached keys and values followed by k, v
// ([B, H_kv, T, D]), which join the cache: causal for a prompt (nothing cached yet), over
// everything for one new token. More than one token after a prompt is refused.
Tensor cached_attention(KVCache::Layer& layer, const Tensor& q, const Tensor& k, const Tensor& v);

// Points each attention module's `cache` at its layer of the cache (sized to the model on
// first use) for one forward, and back to null when it ends -- a throw included.
template <class Attention>
class KVCacheBinding {
 public:
  KVCacheBinding(std::vector<Attention*> attentions, KVCache* cache) : attentions_(std::move(attentions)) {
    if (cache && cache->layers.size() != attentions_.size()) cache->layers.assign(attentions_.size(), {});
    for (size_t i = 0; i < attentions_.size(); ++i) attentions_[i]->cache = cache ? &cache->layers[i] : nullptr;
  }
  ~KVCacheBinding() {
    for (Attention* a : attentions_) a->cache = nullptr;
  }
  KVCacheBinding(const KVCacheBinding&) = delete;
  KVCacheBinding& operator=(const KVCacheBinding&) = delete;

 private:
  std::vector<Attention*> attentions_;
};

}  // namespace zg::nn
