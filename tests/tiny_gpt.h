// The tiny GPT the nn/optim tests train: 2 layers, 2 heads, n_embd 32, on one
// fixed 64-token sequence, with AdamW over flat fp32 spans.
#pragma once

#include "helpers.h"
#include "nn/gpt.h"
#include "optim/adamw.h"
#include "optim/grad_scaler.h"
#include "optim/schedule.h"

namespace zg::test {

inline nn::GPTConfig tiny_config() {
  nn::GPTConfig c;
  c.n_layer = 2, c.n_head = 2, c.n_embd = 32, c.vocab_size = 64, c.block_size = 64;
  return c;
}

// 64 tokens from Philox (seed 2024): inputs are tokens[0:63], targets tokens[1:64].
struct Sequence {
  Tensor inputs, targets;
};
inline Sequence fixed_sequence(int64_t vocab = 64) {
  Context scratch;
  ContextGuard guard(scratch);
  manual_seed(2024);
  const Tensor tokens = (rand({65}, DType::f64) * static_cast<double>(vocab)).to(DType::i64);
  return {tokens.narrow(0, 0, 64).view({1, 64}), tokens.narrow(0, 1, 64).view({1, 64})};
}

struct TinyTrainer {
  std::shared_ptr<nn::GPT> model;
  std::unique_ptr<optim::FlatParameters> flat;
  std::unique_ptr<optim::AdamW> adamw;

  Device device;

  // The model is built (and initialised) on the CPU, then moved to `device`.
  explicit TinyTrainer(DType compute = DType::f32, bool checkpointing = false, uint64_t seed = 1, double dropout = 0,
                       Device device = kCPU)
      : device(device) {
    manual_seed(seed);
    nn::GPTConfig config = tiny_config();
    config.activation_checkpointing = checkpointing;
    config.dropout = dropout;
    model = std::make_shared<nn::GPT>(config);
    model->to(device);
    flat = std::make_unique<optim::FlatParameters>(model->named_parameters(), compute);
    adamw = std::make_unique<optim::AdamW>(*flat, optim::AdamWOptions{0.9, 0.95, 1e-8, 0.0});
  }

  // forward + backward; returns the loss (f32 on the host)
  double forward_backward(const Sequence& s, double loss_scale = 1.0) {
    const Tensor loss = model->forward(s.inputs.to(device), s.targets.to(device)).loss;
    (loss_scale == 1.0 ? loss : loss * loss_scale).backward();
    return loss.item<double>();
  }

  double step(const Sequence& s, double lr) {
    flat->zero_grad();
    const double loss = forward_backward(s);
    adamw->step(lr);
    return loss;
  }
};

}  // namespace zg::test
