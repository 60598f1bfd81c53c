// Task 3 (docs/tasks/README.md): predict, then measure, the peak of ZeRO-3's gathered
// weights when ZeroConfig::prefetch goes from 1 to 2. A unit's forward gathers it and
// starts the gathers of the next `prefetch` units, so 1 + prefetch whole units are held
// at once. The backward gathers the same way, going back, and adds the outputs of the
// reduce-scatters in flight: at most two, a shard (one unit / N) each. Measured on the
// meta device, rank 0 of 8: every byte counted, none allocated.
#include <cstdio>

#include "dist/comm/fake_group.h"
#include "dist/zero/sharded_model.h"
#include "docs/tasks/tower.h"

using namespace zg;

namespace {

constexpr int kDepth = 8, kRanks = 8;
constexpr int64_t kWidth = 256;

// One unit gathered whole: a layer's weight and bias in bf16, padded to a multiple of N.
int64_t unit_bytes() {
  const int64_t numel = kWidth * kWidth + kWidth;
  const int64_t padded = (numel + kRanks - 1) / kRanks * kRanks;
  return 2 * padded;
}

// The backward holds as many gathered units, plus two reduce-scatter outputs of a shard each
// (GradientReducer keeps at most two reductions in flight).
int64_t predicted_backward(int prefetch) { return (1 + prefetch) * unit_bytes() + 2 * unit_bytes() / kRanks; }

// The `communication` peak through one forward alone, and through the backward that follows.
struct Peaks {
  int64_t forward, backward;
};

Peaks measure(int prefetch) {
  const std::unique_ptr<tasks::Tower> model = tasks::deferred_meta_tower(kDepth, kWidth);
  dist::FakeGroup rank0(0, kRanks);
  dist::ShardedModel sharded(*model, rank0, {.stage = 3, .compute_dtype = DType::bf16, .prefetch = prefetch});
  Context& context = Context::current();
  context.allocator(kMeta)->reset_peaks();
  const Tensor loss = sum((*model)(zeros({4, kWidth}, kMeta)));
  const int64_t forward = memory_stats(kMeta).peak_of(MemoryCategory::communication);
  context.allocator(kMeta)->reset_peaks();
  loss.backward();
  return {forward, memory_stats(kMeta).peak_of(MemoryCategory::communication)};
}

}  // namespace

int main() {
  std::printf("ZeRO-3, %d layers Linear(%lld, %lld), rank 0 of %d, bf16: one unit gathered = %lld bytes\n", kDepth,
              (long long)kWidth, (long long)kWidth, kRanks, (long long)unit_bytes());
  std::printf("%8s %12s %12s %12s %12s\n", "prefetch", "forward", "predicted", "backward", "predicted");
  bool agree = true;
  for (int prefetch : {1, 2, 4}) {
    const int64_t forward = (1 + prefetch) * unit_bytes(), backward = predicted_backward(prefetch);
    const Peaks peaks = measure(prefetch);
    agree = agree && peaks.forward == forward && peaks.backward == backward;
    std::printf("%8d %12lld %12lld %12lld %12lld\n", prefetch, (long long)peaks.forward, (long long)forward,
                (long long)peaks.backward, (long long)backward);
  }
  std::printf(agree ? "measured as predicted\n" : "prediction and measurement differ\n");
  return agree ? 0 : 1;
}
