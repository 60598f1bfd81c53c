// The tiny GPT the nn/optim tests train: 2 layers, 2 heads, n_embd 32, on one
// fixed 64-token sequence, through a ShardedModel over a group of one (the one
// training path: AdamW over its units' flat fp32 spans).
#pragma once

#include "dist/comm/fake_group.h"
#include "dist/zero/sharded_model.h"
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

// The values of `tensors`, one after another in row-major order, as f32.
inline std::vector<float> flat_values(const nn::NamedTensors& tensors) {
  std::vector<float> out;
  for (const auto& [name, t] : tensors) {
    const std::vector<float> values = t.to(kCPU).to(DType::f32).reshape({-1}).to_vector<float>();
    out.insert(out.end(), values.begin(), values.end());
  }
  return out;
}

// Every parameter's gradient, in named_parameters() order.
inline std::vector<float> gradients_of(const nn::Module& model) {
  nn::NamedTensors grads;
  for (const auto& [name, p] : model.named_parameters()) grads.emplace_back(name, p.grad());
  return flat_values(grads);
}

struct TinyTrainer {
  std::shared_ptr<nn::GPT> model;
  dist::SingleRank one;
  std::unique_ptr<dist::ShardedModel> trainer;
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
    trainer = std::make_unique<dist::ShardedModel>(
        *model, one, dist::ZeroConfig{.compute_dtype = compute, .adamw = {0.9, 0.95, 1e-8, 0.0}});
  }

  // forward + backward; returns the loss (f32 on the host)
  double forward_backward(const Sequence& s, double loss_scale = 1.0) {
    const Tensor loss = model->forward(s.inputs.to(device), s.targets.to(device)).loss;
    (loss_scale == 1.0 ? loss : loss * loss_scale).backward();
    return loss.item<double>();
  }

  // One training step (the loss scaled by `scaler`, if given); returns the loss.
  double step(const Sequence& s, double lr, optim::GradScaler* scaler = nullptr) {
    trainer->zero_grad();
    const double loss = forward_backward(s, scaler ? scaler->scale_factor() : 1.0);
    trainer->step(lr, scaler);
    return loss;
  }
};

}  // namespace zg::test
