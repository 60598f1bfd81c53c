// ZeRO++ beyond qwZ (test_zero_stage3): hpZ's secondary partition (the same bits as
// ZeRO-3, its gathers within the node, 2Ψ/S more a rank) and qgZ's hierarchical
// all-to-all (within the quantization bound of the exact average, its bytes within and
// across nodes as the formula says), and what each refuses.
#include "dist/comm/fake_group.h"
#include "dist/comm/local_group.h"
#include "dist/zero/quantized_reduce.h"
#include "dist/zero/sharded_model.h"
#include "tensor/quant_blocks.h"
#include "tensor/quantize.h"
#include "zero_cases.h"
#include "zero_training.h"

namespace zg::test {

namespace {

// 3 steps of the tiny GPT at N = 4 (2 nodes of 2), each of two forwards and backwards (the
// rank's row, in halves: the second forward gathers from hpZ's partition too); the master
// weights, and the bytes each group sent (shard, node, across).
struct Trained {
  nn::NamedTensors master;
  int64_t shard_bytes = 0, node_bytes = 0, across_bytes = 0;
};
Trained train(dist::ZeroConfig config) {
  Trained kept;
  config.stage = 3, config.adamw = kAdamW, config.ranks_per_node = 2;
  dist::run_local(4, [&](dist::ProcessGroup& pg) {
    manual_seed(1);
    nn::GPT model(zero_config());
    dist::ShardedModel sharded(model, pg, config);
    for (int s = 0; s < 3; ++s) {
      const auto [x, y] = global_batch(s);
      sharded.zero_grad();
      for (int half = 0; half < 2; ++half) {
        sharded.set_gradient_sync(half == 1);
        const auto part = [&](const Tensor& t) { return t.narrow(0, pg.rank(), 1).narrow(1, 8 * half, 8); };
        (model.forward(part(x), part(y)).loss * 0.5).backward();
      }
      sharded.step(1e-3);
    }
    const nn::NamedTensors master = sharded.gathered_master();
    if (pg.rank() == 0) {
      kept.master = master;
      kept.shard_bytes = sharded.shard_group().bytes_sent();
      if (sharded.node_group()) kept.node_bytes = sharded.node_group()->bytes_sent();
      if (sharded.across_group()) kept.across_bytes = sharded.across_group()->bytes_sent();
    }
  });
  return kept;
}

}  // namespace

TEST_CASE("hpZ (secondary_weights) trains ZeRO-3's bits exactly, with qwZ too, its later gathers within the node") {
  for (const DType dtype : {DType::f32, DType::bf16}) {
    INFO(name(dtype));
    const Trained plain = train({.compute_dtype = dtype});
    const Trained hpz = train({.compute_dtype = dtype, .secondary_weights = true});
    CHECK(max_difference(hpz.master, plain.master) == 0.0);
    // Each step gathers every unit over all N once (the first forward) instead of four times;
    // the other three gathers (a backward, the second forward, its backward) within the node.
    CHECK(hpz.node_bytes > 0);
    CHECK(hpz.across_bytes == 0);
    const double per_gather_all = (plain.shard_bytes - hpz.shard_bytes) / 3.0;  // plain: 4 gathers, hpZ: 1
    CHECK(per_gather_all > 0);
    // A gather within 2 ranks sends 1/2 of the weights, over 4 ranks 3/4: a ratio of 2/3 (each
    // collective's count rounded to whole bytes).
    CHECK(std::abs(hpz.node_bytes / 3.0 / per_gather_all - 2.0 / 3.0) < 1e-3);
    const Trained qwz = train({.compute_dtype = dtype, .quantize_weights = true});
    const Trained both = train({.compute_dtype = dtype, .quantize_weights = true, .secondary_weights = true});
    CHECK(max_difference(both.master, qwz.master) == 0.0);  // the secondary keeps what the forward used
    // qgZ: near the exact run (AdamW's steps are about lr whatever the gradient's scale: 3
    // steps of 1e-3), its reductions on the node and across groups, none on the shard group's.
    for (const int bits : {8, 4}) {
      const Trained qgz = train({.compute_dtype = dtype, .gradient_bits = bits});
      CHECK(max_difference(qgz.master, plain.master) > 0.0);
      CHECK(max_difference(qgz.master, plain.master) < 1e-2);
      CHECK(qgz.node_bytes > 0);
      CHECK(qgz.across_bytes > 0);
      CHECK(qgz.shard_bytes < plain.shard_bytes);
    }
  }
}

TEST_CASE("hpZ holds 2Ψ/S more a rank: 16Ψ/N + 2Ψ/S in a dry run of GPT-2 124M at N = 64, S = 8") {
  Context rank0;
  ContextGuard guard(rank0);
  dist::FakeGroup group(0, 64);
  nn::GPT model(nn::GPTConfig{}, kMeta);
  dist::ShardedModel sharded(model, group,
                             {.stage = 3, .compute_dtype = DType::bf16, .secondary_weights = true, .ranks_per_node = 8});
  const MemoryStats stats = memory_stats(kMeta);
  const int64_t psi = sharded.num_parameters();
  const double states = static_cast<double>(stats[MemoryCategory::parameter] + stats[MemoryCategory::gradient] +
                                            stats[MemoryCategory::optimizer_state]);
  CHECK(std::abs(states / (16.0 * psi / 64 + 2.0 * psi / 8) - 1) < 0.001);  // the padding
  CHECK(sharded.node_group()->size() == 8);
  CHECK(sharded.across_group()->size() == 8);
  // Without ranks_per_node the mesh's node holds: 16 ranks a node of the mesh, dp_shard's ranks
  // 2 apart under tp 2, are 8 of the shard group's.
  dist::FakeGroup world(0, 128);
  nn::GPT small(zero_config(), kMeta);
  const auto mesh = dist::training_mesh(world, {.tp = 2, .ranks_per_node = 16});
  dist::ShardedModel on_mesh(small, *mesh, {.stage = 3, .secondary_weights = true});
  CHECK(on_mesh.node_group()->size() == 8);
  CHECK(on_mesh.across_group()->size() == 8);
}

TEST_CASE("qgZ's hierarchical all-to-all: the average within the two hops' quantization bound, its bytes as counted") {
  // N = 8 as 2 nodes of 4; each rank's gradient of 8 slices of 3000 (a short last block a slice).
  constexpr int kN = 8, kS = 4;
  constexpr int64_t kSlice = 3000;
  const auto gradient = [](int rank) {
    Context scratch;
    ContextGuard guard(scratch);
    manual_seed(40 + rank);
    return randn({kN * kSlice}) * (1.0 + rank);
  };
  Tensor exact = zeros({kN * kSlice});
  for (int r = 0; r < kN; ++r) exact = exact + gradient(r) * (1.0 / kN);
  for (const int bits : {8, 4}) {
    INFO(bits << " bits");
    std::vector<double> error(kN), bound(kN);
    std::vector<int64_t> within(kN), across(kN);
    dist::run_local(kN, [&](dist::ProcessGroup& pg) {
      const auto node = pg.split_grid(kS, 1), nodes = pg.split_grid(kN / kS, kS);
      const Tensor out = empty({kSlice});
      bool finished = false;
      dist::InFlight job = dist::quantized_reduce_scatter(*node, *nodes, gradient(pg.rank()), out, bits, 2048, [&] {
        finished = true;
        return dist::InFlight{};
      });
      while (job.work) {
        job.work->wait();
        job = job.then ? job.then() : dist::InFlight{};
      }
      CHECK(finished);
      const Tensor want = exact.narrow(0, pg.rank() * kSlice, kSlice);
      error[pg.rank()] = max_abs_diff(out, want);
      // Each hop rounds each value by at most half its block's scale, max|x| / L: S values in
      // hop 1 (the largest gradient bounds them all), the R node sums in hop 2; then / N.
      const double largest = 1.0 + kN;  // randn within 4.5 sigma here, scaled by 1 + rank <= N
      const double levels = bits == 8 ? 127 : 7;
      bound[pg.rank()] = (kS * 4.5 * largest / levels / 2 + (kN / kS) * kS * 4.5 * largest * (1 + 0.5 / levels) / levels / 2) / kN;
      within[pg.rank()] = node->bytes_sent(), across[pg.rank()] = nodes->bytes_sent();
    });
    const double per_element = bits / 8.0;
    for (int r = 0; r < kN; ++r) {
      INFO("rank " << r);
      CHECK(error[r] > 0);
      CHECK(error[r] <= bound[r]);
      // Hop 1 sends 3 of 4 chunks of 2 slices each; hop 2 one chunk of one slice; scales: per chunk,
      // ceil(chunk / 2048) of 4 bytes.
      CHECK(within[r] == static_cast<int64_t>(3 * (2 * kSlice * per_element + 3 * 4)));
      CHECK(across[r] == static_cast<int64_t>(kSlice * per_element + 2 * 4));
    }
  }
}

TEST_CASE("hpZ and qgZ refuse what they cannot do, naming it") {
  nn::GPT model(zero_config());
  dist::FakeGroup group(0, 8);
  const auto refused = [&](dist::ZeroConfig config, const char* why) {
    CHECK_THROWS_WITH_AS(dist::ShardedModel(model, group, config), doctest::Contains(why), Error);
  };
  refused({.stage = 2, .secondary_weights = true, .ranks_per_node = 4},
          "secondary_weights (hpZ) keeps a node's copy of ZeRO-3's gathered weights; stage 2");
  refused({.stage = 1, .gradient_bits = 4}, "gradient_bits (qgZ) quantizes the reduce-scatter of stages 2 and 3; stage 1");
  refused({.stage = 3, .gradient_bits = 2}, "gradient_bits (qgZ) must be 4 or 8 (0: reduce unquantized), got 2");
  refused({.stage = 3, .reduce_dtype = DType::f32, .gradient_bits = 4}, "leave reduce_dtype unset (it was f32)");
  refused({.stage = 3, .shard_group_size = 4, .secondary_weights = true},
          "hybrid sharding (shard_group_size 4) keeps every collective within its group already");
  refused({.stage = 3, .gradient_bits = 4, .ranks_per_node = 3}, "ranks_per_node 3 must divide the 8 data-parallel ranks");
  refused({.stage = 3, .secondary_weights = true},
          "secondary_weights (hpZ) with the 8 ranks of the shard group on one node would copy the shard each has");
}

}  // namespace zg::test
