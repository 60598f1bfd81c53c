#include "dist/pipeline/stages.h"

#include "autograd/functions.h"
#include "nn/checkpoint.h"

namespace zg::dist {

namespace {

// Blocks [first, end) of a GPT, with the embeddings before them on the first stage and
// ln_f and the head after them on the last -- GPT::logits, cut. Its parameters keep the
// model's names (transformer.h.2.attn.c_attn.weight, ...).
class GPTStage final : public nn::Module {
 public:
  GPTStage(nn::GPT& model, int64_t first, int64_t end, bool embeds, bool heads)
      : model_(model), embeds_(embeds), heads_(heads) {
    const auto transformer = register_module("transformer", std::make_shared<nn::Module>());
    if (embeds_) transformer->register_module("wte", model.wte), transformer->register_module("wpe", model.wpe);
    const auto h = transformer->register_module("h", std::make_shared<nn::Module>());
    for (int64_t i = first; i < end; ++i)
      blocks_.push_back(h->register_module(std::to_string(i), model.h->ptr<nn::Module>(static_cast<size_t>(i))));
    if (heads_) transformer->register_module("ln_f", model.ln_f), register_module("lm_head", model.lm_head);
  }

  Tensor forward(const Tensor& input) override {
    const nn::GPTConfig& config = model_.config;
    Tensor x = input;
    if (embeds_) {
      const Tensor positions = arange(0.0, static_cast<double>(input.size(1)), 1.0,
                                      TensorOptions(DType::i64).device(input.device()));
      x = dropout((*model_.wte)(input) + (*model_.wpe)(positions), config.dropout, is_training());
    }
    for (const auto& block : blocks_) {
      nn::Module& b = *block;
      x = config.activation_checkpointing ? nn::checkpoint([&b](const std::vector<Tensor>& in) { return b(in[0]); }, {x})
                                          : b(x);
    }
    if (!heads_) return x;
    x = (*model_.ln_f)(x);
    const Tensor& wte = model_.wte->weight;
    return matmul(x.reshape({-1, config.n_embd}), wte, false, true).view({x.size(0), x.size(1), wte.size(0)});
  }

 private:
  nn::GPT& model_;
  bool embeds_, heads_;
  std::vector<std::shared_ptr<nn::Module>> blocks_;
};

}  // namespace

Stages gpt_stages(nn::GPT& model, int stages) {
  const int64_t layers = model.config.n_layer;
  ZG_CHECK(stages >= 1 && stages <= layers, "gpt_stages: ", stages, " stages for a GPT of ", layers,
           " layers; each stage needs at least one block");
  Stages out;
  for (int64_t s = 0, first = 0; s < stages; ++s) {
    const int64_t end = first + layers / stages + (s < layers % stages ? 1 : 0);
    out.modules.push_back(std::make_shared<GPTStage>(model, first, end, s == 0, s == stages - 1));
    first = end;
  }
  if (stages > 1) out.tied.push_back(model.wte->weight);
  return out;
}

Tensor causal_lm_loss(const Tensor& logits, const Tensor& targets) { return cross_entropy(logits, targets, -1); }

}  // namespace zg::dist
