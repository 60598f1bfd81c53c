// The training run the ZeRO tests repeat on every process group and stage: the
// tiny GPT, 4 x 16 tokens per global batch split across ranks, AdamW on the local
// shards. Plain C++ (no doctest), so the mpirun worker shares it.
#pragma once

#include "dist/zero/sharded_model.h"
#include "nn/gpt.h"
#include "zerograd.h"

namespace zg::test {

constexpr int64_t kBatch = 4, kTime = 16;
inline const optim::AdamWOptions kAdamW{0.9, 0.95, 1e-8, 0.1};

inline nn::GPTConfig zero_config(bool checkpointing = false) {
  nn::GPTConfig c;
  c.n_layer = 2, c.n_head = 2, c.n_embd = 32, c.vocab_size = 64, c.block_size = 64;
  c.activation_checkpointing = checkpointing;
  return c;
}

// The global batch of step s: token ids [4, 16] and next-token targets.
inline std::pair<Tensor, Tensor> global_batch(int s) {
  Context scratch;
  ContextGuard guard(scratch);
  manual_seed(100 + s);
  const Tensor tokens = (rand({kBatch, kTime + 1}, DType::f64) * 64.0).to(DType::i64);
  return {tokens.narrow(1, 0, kTime).contiguous(), tokens.narrow(1, 1, kTime).contiguous()};
}

struct ZeroRun {
  DType dtype = DType::f32;
  int stage = 0;
  int steps = 5;
  int micro_batches = 1;  // gradient accumulation
  bool sync_every_micro_batch = false;  // else gradient sync only for the last one
  bool zero_grad_through_model = false;  // Module::zero_grad(), which the ShardedModel serves
  double clip = 0;
  bool checkpointing = false;
  std::optional<DType> reduce_dtype{};
  int64_t bucket_bytes = 25 << 20;
  int prefetch = 1;
  bool unused_parameter = false;  // a parameter registered on the model that no forward uses
  Device device = kCPU;  // on a GPU, the ranks share it (each with its own allocator and streams)
  int shard_group_size = 0;  // hybrid sharding

  dist::ZeroConfig config() const {
    return {.stage = stage, .compute_dtype = dtype, .adamw = kAdamW, .max_grad_norm = clip,
            .reduce_dtype = reduce_dtype, .bucket_bytes = bucket_bytes, .prefetch = prefetch,
            .shard_group_size = shard_group_size};
  }
};

// The tiny GPT of a run (seed 1 before it), with its unused parameter if it has one.
inline std::unique_ptr<nn::GPT> zero_model(const ZeroRun& run) {
  auto model = std::make_unique<nn::GPT>(zero_config(run.checkpointing), TensorOptions(DType::f32).device(run.device));
  if (run.unused_parameter) model->register_parameter("unused", ones({3}, TensorOptions(DType::f32).device(run.device)));
  return model;
}

// Trains on this rank's slice of every global batch; returns the gathered master
// weights (on every rank).
inline nn::NamedTensors train_sharded(dist::ProcessGroup& pg, const ZeroRun& run) {
  manual_seed(1);
  const std::unique_ptr<nn::GPT> owned = zero_model(run);
  nn::GPT& model = *owned;
  dist::ShardedModel sharded(model, pg, run.config());
  const int64_t rows = kBatch / pg.size();
  const int micro = rows >= run.micro_batches ? run.micro_batches : 1;
  for (int s = 0; s < run.steps; ++s) {
    const auto [x, y] = global_batch(s);
    const Tensor my_x = x.narrow(0, pg.rank() * rows, rows).to(run.device);
    const Tensor my_y = y.narrow(0, pg.rank() * rows, rows).to(run.device);
    if (run.zero_grad_through_model) model.zero_grad();
    else sharded.zero_grad();
    for (int k = 0; k < micro; ++k) {
      sharded.set_gradient_sync(run.sync_every_micro_batch || k == micro - 1);
      const int64_t r = rows / micro;
      (model.forward(my_x.narrow(0, k * r, r), my_y.narrow(0, k * r, r)).loss * (1.0 / micro)).backward();
    }
    sharded.step(1e-3);
  }
  nn::NamedTensors out;
  for (auto& [name, t] : sharded.gathered_master()) out.emplace_back(name, t.to(kCPU).clone());
  return out;
}

}  // namespace zg::test
