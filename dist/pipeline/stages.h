// A model cut into pipeline stages: the module of each of its S stages, in order, for the
// Pipeline executor (pipeline.h) -- rank r takes stages r, r + p, ... -- and the
// parameters its first and last stage share (a tied embedding), whose gradients the two
// ends sum after each step.
//
// A model of your own states its stages by building them: any modules, one per stage,
// whose outputs feed the next stage's inputs.
#pragma once

#include <memory>
#include <vector>

#include "nn/gpt.h"

namespace zg::dist {

struct Stages {
  std::vector<std::shared_ptr<nn::Module>> modules;  // stage s's, s = 0 .. S-1
  std::vector<Tensor> tied;                          // held by the first stage and the last
};

// GPT cut into `stages`: the embeddings (wte, wpe, dropout) on the first, the blocks
// spread evenly (the first n_layer % S stages one more), ln_f and the head -- wte,
// transposed -- on the last, so wte is tied between the ends. Stage 0 takes token ids
// [B, T]; each stage gives hidden states [B, T, C], the last logits [B, T, V]. The stages
// share the model's modules: train the stages, and the model has the result.
Stages gpt_stages(nn::GPT& model, int stages);

// The last stage's loss for a causal language model: the mean cross-entropy of logits
// [B, T, V] against targets [B, T], a target of -1 ignored (nn::CausalLM's).
Tensor causal_lm_loss(const Tensor& logits, const Tensor& targets);

}  // namespace zg::dist
