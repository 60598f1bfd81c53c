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

#include "dist/pipeline/pipeline.h"
#include "nn/gpt.h"
#include "nn/llama.h"

namespace zg::dist {

struct Stages {
  std::vector<std::shared_ptr<nn::Module>> modules;  // stage s's, s = 0 .. S-1
  // Held by the first stage and the last, for a Pipeline without a ShardedModel (with one,
  // the stages' unit plans tie them: UnitPlan::tied).
  std::vector<Tensor> tied;
  PipelineLoss loss;  // the last stage's: of its output and the targets

  // Rank `rank`'s chunks under `schedule`: stages rank, rank + p, ... (schedule.stages() of them in all).
  std::vector<std::shared_ptr<nn::Module>> chunks(const Schedule& schedule, int rank) const;
};

// A rank's chunks held as one module, for a ShardedModel over a mesh with a pp dimension:
// each chunk's submodules under their own names (containers such as a GPT's "transformer"
// and "transformer.h", plain nn::Modules, joined into one), and the chunks' unit plans
// joined. A tie whose two ends are both here (one rank holding the first stage and the
// last) is no tie: its second unit is dropped. The Pipeline runs the chunks themselves;
// this module's own forward is refused.
std::shared_ptr<nn::Module> join_chunks(const std::vector<std::shared_ptr<nn::Module>>& chunks);

// GPT cut into `stages`: the embeddings (wte, wpe, dropout) on the first, the blocks
// spread evenly (the first n_layer % S stages one more), ln_f and the head -- wte,
// transposed -- on the last, so wte is tied between the ends. Stage 0 takes token ids
// [B, T]; each stage gives hidden states [B, T, C], the last logits [B, T, V] and its loss
// is the model's (nn::CausalLM::loss: vocabulary-parallel when cut by tp). The stages
// share the model's modules: train the stages, and the model has the result. Each stage's
// unit plan has a unit per block; the first stage's wte and the last stage's head (holding
// wte's weight under its name, transformer.wte.weight) are units of their own, tied.
Stages gpt_stages(nn::GPT& model, int stages);

// Llama cut alike: embed_tokens on the first stage, norm and lm_head on the last (with tied
// embeddings, a head reading embed_tokens' weight, tied as GPT's). Every stage starts its
// rotary positions at 0.
Stages llama_stages(nn::Llama& model, int stages);

}  // namespace zg::dist
