// Task 1 (docs/tasks/README.md): the bytes a rank keeps for Adam with 8-bit optimizer
// states (bitsandbytes: m and v one byte each, with one f32 scale per block of 2048
// values), at ZeRO stage k on N ranks. The formula is checked first on the case the
// library trains -- bf16 weights and gradients, f32 master, m and v: 16 bytes -- against
// the bytes a ShardedModel really allocates (a dry run on the meta device); then it
// prints GPT-2 124M's figures with both optimizers.
#include <cstdio>

#include "dist/comm/fake_group.h"
#include "dist/zero/sharded_model.h"
#include "docs/tasks/tower.h"

using namespace zg;

namespace {

// What one parameter costs in each role, before sharding. `blocked` bytes are per block
// of `block` values of a rank's optimizer shard (8-bit Adam's scales: 4 bytes for m's
// block, 4 for v's); the rest are per parameter.
struct StateBytes {
  int64_t weights, gradients, optimizer;
  int64_t blocked = 0, block = 1;
};
constexpr StateBytes kAdamW{.weights = 2, .gradients = 2, .optimizer = 4 + 4 + 4};  // master, m, v in f32
constexpr StateBytes kAdam8bit{.weights = 2, .gradients = 2, .optimizer = 4 + 1 + 1, .blocked = 4 + 4, .block = 2048};

// Model-state bytes of one rank: stage 1 shards the optimizer state over the N ranks,
// stage 2 also the gradients, stage 3 also the weights (psi divisible by N here; the
// library pads each unit up to a multiple of N).
int64_t model_state_bytes(const StateBytes& b, int64_t psi, int stage, int n) {
  const int64_t shard = psi / n;
  const int64_t optimizer_elements = stage >= 1 ? shard : psi;
  const int64_t blocks = (optimizer_elements + b.block - 1) / b.block;  // every block of the shard has its scales
  return b.weights * (stage >= 3 ? shard : psi) + b.gradients * (stage >= 2 ? shard : psi) +
         b.optimizer * optimizer_elements + b.blocked * blocks;
}

// What rank 0 of N allocates for parameters, gradients and optimizer state after a
// backward (the moment the formula describes: stage 2's full gradients are gone).
int64_t measured_model_states(int stage, int n, int64_t* psi) {
  // Eight layers of 64 x 64 + 64 = 4,160 parameters, a multiple of 64: no padding up to N = 64.
  const std::unique_ptr<tasks::Tower> model = tasks::deferred_meta_tower(8, 64);
  dist::FakeGroup rank0(0, n);
  dist::ShardedModel sharded(*model, rank0, {.stage = stage, .compute_dtype = DType::bf16});
  *psi = sharded.num_parameters();
  sum((*model)(zeros({4, 64}, kMeta))).backward();
  const MemoryStats stats = memory_stats(kMeta);
  return stats[MemoryCategory::parameter] + stats[MemoryCategory::gradient] + stats[MemoryCategory::optimizer_state];
}

}  // namespace

int main() {
  std::printf("bf16 weights and gradients, f32 master, m and v: measured on the meta device against the formula\n");
  std::printf("%5s %4s %10s %10s\n", "stage", "N", "measured", "formula");
  bool all_equal = true;
  for (int stage : {0, 1, 2, 3})
    for (int n : {1, 4, 64}) {
      int64_t psi = 0;
      const int64_t measured = measured_model_states(stage, n, &psi);
      const int64_t formula = model_state_bytes(kAdamW, psi, stage, n);
      all_equal = all_equal && measured == formula;
      std::printf("%5d %4d %10lld %10lld%s\n", stage, n, (long long)measured, (long long)formula,
                  measured == formula ? "" : "  <- differs");
    }

  const int64_t psi = 124'439'808;  // GPT-2 124M
  const int n = 8;
  std::printf("\nGPT-2 124M, Psi = %lld, N = %d: bytes a rank\n", (long long)psi, n);
  std::printf("%5s %14s %14s %12s\n", "stage", "AdamW f32", "Adam 8-bit", "8-bit/param");
  for (int stage : {0, 1, 2, 3}) {
    const int64_t eight = model_state_bytes(kAdam8bit, psi, stage, n);
    std::printf("%5d %14lld %14lld %12.4f\n", stage, (long long)model_state_bytes(kAdamW, psi, stage, n),
                (long long)eight, static_cast<double>(eight) / static_cast<double>(psi));
  }
  return all_equal ? 0 : 1;
}
