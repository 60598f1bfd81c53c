// The model a bench measures: a GPT (zero_memory's presets, or a shape of one's own) or a
// Llama-family decoder (Llama 3's shapes, or any config.json nn::hf_llama_config reads) --
// one value the dry runs build, cut into pipeline stages and count FLOPs of.
//
//   FLOPs a token of training (PaLM, Chowdhery et al. 2022, appendix B; torchtitan's count):
//     6 Ψ' + 12 L h T    Ψ' the parameters a token multiplies by (all but the input embedding's,
//                        which is a lookup; a tied head's are counted once, as the head), L
//                        layers, h width, T the sequence: attention's scores and values
#pragma once

#include <memory>
#include <string>
#include <variant>

#include "dist/pipeline/stages.h"
#include "nn/gpt.h"
#include "nn/llama.h"
#include "tensor/deferred.h"

namespace zg::bench {

struct ModelShape {
  std::string name;  // "124m", "llama3-8b", a config file's folder
  std::variant<nn::GPTConfig, nn::LlamaConfig> config;

  bool is_gpt() const { return std::holds_alternative<nn::GPTConfig>(config); }
  const nn::GPTConfig& gpt() const { return std::get<nn::GPTConfig>(config); }
  const char* family() const { return is_gpt() ? "GPT" : "Llama"; }
  std::string title() const { return std::string(family()) + " " + name; }

  template <class Fn>
  decltype(auto) visit(Fn&& fn) const { return std::visit(fn, config); }
  int64_t layers() const { return visit([](const auto& c) { return c.n_layer; }); }
  int64_t width() const { return visit([](const auto& c) { return c.n_embd; }); }
  int64_t heads() const { return visit([](const auto& c) { return c.n_head; }); }
  int64_t block() const { return visit([](const auto& c) { return c.block_size; }); }
  int64_t vocab() const { return visit([](const auto& c) { return c.vocab_size; }); }
  int64_t kv_heads() const { return is_gpt() ? heads() : std::get<nn::LlamaConfig>(config).n_kv_head; }

  void set_checkpointing(bool on) {
    std::visit([on](auto& c) { c.activation_checkpointing = on; }, config);
  }
  // A GPT trained on sequences longer than its block gets the positions for them (wpe grows);
  // a Llama's block is its config's max_position_embeddings, which a longer sequence exceeds.
  void fit_sequence(int64_t seq) {
    if (auto* gpt = std::get_if<nn::GPTConfig>(&config)) gpt->block_size = std::max(gpt->block_size, seq);
    ZG_CHECK(seq <= block(), "zero_memory: --seq ", seq, " is longer than ", title(), "'s ", block(),
             " positions (its config's max_position_embeddings); give a shorter --seq");
  }

  // The model, built without memory (every parameter a recipe until a ShardedModel makes it).
  std::shared_ptr<nn::CausalLM> make(TensorOptions options) const {
    DeferredInit nothing_allocated;
    return visit([&](const auto& c) -> std::shared_ptr<nn::CausalLM> {
      if constexpr (std::is_same_v<std::decay_t<decltype(c)>, nn::GPTConfig>) return std::make_shared<nn::GPT>(c, options);
      else return std::make_shared<nn::Llama>(c, options);
    });
  }
  dist::Stages stages(nn::CausalLM& model, int count) const {
    if (is_gpt()) return dist::gpt_stages(static_cast<nn::GPT&>(model), count);
    return dist::llama_stages(static_cast<nn::Llama&>(model), count);
  }

  double flops_per_token(int64_t seq, int64_t params) const {
    const int64_t input_embedding = is_gpt() ? (gpt().block_size * width())  // wpe; wte is the tied head
                                             : (std::get<nn::LlamaConfig>(config).tie_embeddings ? 0 : vocab() * width());
    return 6.0 * static_cast<double>(params - input_embedding) +
           12.0 * static_cast<double>(layers() * width() * seq);
  }
};

// Llama 3's shapes (Meta's config.json files: Llama-3-8B and Llama-3-70B; 3.1 adds rope scaling).
inline nn::LlamaConfig llama3(int64_t layers, int64_t width, int64_t heads, int64_t intermediate) {
  nn::LlamaConfig c;
  c.n_layer = layers, c.n_embd = width, c.n_head = heads, c.n_kv_head = 8, c.intermediate_size = intermediate;
  c.vocab_size = 128256, c.block_size = 8192, c.rope_theta = 500000.0, c.norm_eps = 1e-5;
  return c;
}

}  // namespace zg::bench
