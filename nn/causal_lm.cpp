#include "nn/causal_lm.h"

#include "autograd/functions.h"

namespace zg::nn {

void CausalLM::check_tokens(const Tensor& idx, const KVCache* cache) const {
  const std::string full = type_name(typeid(*this)), model = full.substr(full.rfind(':') + 1);  // "GPT", "Llama"
  ZG_CHECK(idx.defined() && idx.dim() == 2 && is_integral(idx.dtype()), model,
           ": expected token ids [B, T] (i32/i64), got ", describe(idx));
  ZG_CHECK(cache == nullptr || sequence_pieces_.whole(), model, ": generation with a KV cache on a model whose "
           "sequences are cut across a context-parallel group is not supported; generate with a model built whole");
  const int64_t length = (cache ? cache->length() : 0) + sequence_pieces_.whole_length(idx.size(1));
  ZG_CHECK(length <= block_size(), model, ": sequence of ", length, " tokens is longer than block_size ", block_size());
}

Tensor CausalLM::positions(int64_t length, int64_t offset, Device device) const {
  const TensorOptions ids = TensorOptions(DType::i64).device(device);
  if (sequence_pieces_.whole())
    return arange(static_cast<double>(offset), static_cast<double>(offset + length), 1.0, ids);
  const int64_t piece = sequence_pieces_.whole_length(length) / sequence_pieces_.parts;
  std::vector<Tensor> runs;  // piece h: positions [h piece, (h + 1) piece)
  for (int h : sequence_pieces_.held)
    runs.push_back(arange(static_cast<double>(h * piece), static_cast<double>((h + 1) * piece), 1.0, ids));
  return cat(runs, 0);
}

int64_t CausalLM::num_parameters() const {
  int64_t n = 0;
  for (const auto& [_, p] : named_parameters()) n += p.numel();
  return n;
}

CausalLMOutput CausalLM::forward(const Tensor& idx, const Tensor& targets) {
  check_tokens(idx, nullptr);
  CausalLMOutput out;
  out.logits = logits(idx, nullptr);
  if (targets.defined()) out.loss = loss(out.logits, targets);
  return out;
}

Tensor CausalLM::loss(const Tensor& logits, const Tensor& targets) const {
  if (!vocab_shards_) return cross_entropy(logits, targets, -1);
  return vocab_shards_->cross_entropy(logits.view({-1, logits.size(-1)}), targets.reshape({-1}));
}

Tensor CausalLM::forward(const Tensor& idx, KVCache& cache) {
  check_tokens(idx, &cache);
  const Tensor out = logits(idx, &cache);
  return vocab_shards_ ? vocab_shards_->gather(out) : out;
}

}  // namespace zg::nn
