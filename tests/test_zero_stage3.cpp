// ZeRO-3: the units whole at each moment of the forward, summon_full_params,
// keep_after_forward and prefetch bounds, and weights used outside the plan's uses or in
// different orders on different ranks: an error, not wrong gradients.
#include "dist/comm/fake_group.h"
#include "dist/comm/local_group.h"
#include "dist/zero/sharded_model.h"
#include "tensor/quantize.h"
#include "zero_cases.h"
#include "zero_training.h"

#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <unistd.h>

namespace zg::test {

// One step of GPT-2 124M as rank 0 of 4 on the meta device, over one sequence of 64:
// bytes sent, the peak of `communication` bytes (gathered weights), Ψ.
static std::tuple<double, int64_t, double> dry_run_gpt2_step(const dist::ZeroConfig& config) {
  Context rank0;
  ContextGuard guard(rank0);
  dist::FakeGroup group(0, 4);
  nn::GPT model(nn::GPTConfig{}, kMeta);
  dist::ShardedModel sharded(model, group, config);
  const Tensor ids = zeros({1, 64}, TensorOptions(DType::i64).device(kMeta));
  sharded.zero_grad();
  group.reset_bytes_sent();
  model.forward(ids, ids).loss.backward();
  sharded.step(1e-3);
  return std::tuple{static_cast<double>(group.bytes_sent()), memory_stats(kMeta).peak_of(MemoryCategory::communication),
                    static_cast<double>(sharded.num_parameters())};
}

TEST_CASE("ZeRO-3 holds exactly the units in use (and those prefetched) during the forward") {
  nn::GPTConfig config = zero_config();
  config.n_layer = 4;
  for (int prefetch : {0, 1, 2})
    dist::run_local(2, [&](dist::ProcessGroup& pg) {
      INFO("prefetch " << prefetch);
      manual_seed(1);
      nn::GPT model(config);
      dist::ShardedModel sharded(model, pg,
                                 {.stage = 3, .compute_dtype = DType::bf16, .prefetch = prefetch});
      // Gathered bytes of a block and of the root unit: bf16, padded to a multiple of N = 2.
      int64_t block = 0, root = 0;
      for (const auto& [name, p] : model.named_parameters()) {
        if (name.starts_with("transformer.h.0.")) block += p.numel();
        if (!name.starts_with("transformer.h.")) root += p.numel();
      }
      block = (block + 1) / 2 * 2 * 2;
      root = (root + 1) / 2 * 2 * 2;
      std::vector<int64_t> seen;  // communication bytes as each block starts (after ShardedModel's own pre-hook)
      for (size_t i = 0; i < model.h->size(); ++i)
        (*model.h)[i].register_forward_pre_hook([&](nn::Module&, const Tensor&) {
          seen.push_back(memory_stats()[MemoryCategory::communication]);
          return Tensor();
        });
      const auto [x, y] = global_batch(0);
      const Tensor loss = model.forward(x.narrow(0, 2 * pg.rank(), 2), y.narrow(0, 2 * pg.rank(), 2)).loss;
      // Block k, plus the next `prefetch` uses: blocks, then the root (for ln_f and the head).
      std::vector<int64_t> expected;
      for (int k = 0; k < 4; ++k) {
        int64_t bytes = block;
        for (int ahead = 1; ahead <= prefetch; ++ahead) bytes += k + ahead < 4 ? block : k + ahead == 4 ? root : 0;
        expected.push_back(bytes);
      }
      CHECK(seen == expected);
      // After the forward only the last use's unit (the root) is whole: the backward starts there.
      CHECK(memory_stats()[MemoryCategory::communication] == root);
      loss.backward();
      CHECK(memory_stats()[MemoryCategory::communication] == 0);
    });
}

TEST_CASE("ZeRO-3: summon_full_params keeps every unit whole -- parameters readable, forwards gather nothing, writes refused") {
  // f32 compute: the compute weights hold the master weights' values.
  const std::string dir = "/tmp/zg_test_summon_" + std::to_string(::getpid());
  int64_t units = 0;  // bytes of every unit's full weights, each padded to a multiple of N = 2
  std::map<std::string, int64_t> numel;
  for (const auto& [name, p] : nn::GPT(zero_config(), kMeta).named_parameters())
    numel[name.starts_with("transformer.h.") ? name.substr(0, name.find('.', 14)) : "root"] += p.numel();
  for (const auto& [unit, count] : numel) units += (count + 1) / 2 * 2 * 4;
  const auto run = [&](int stage, const std::function<void(dist::ProcessGroup&, nn::GPT&, dist::ShardedModel&,
                                                           const std::function<void(int)>&)>& fn) {
    dist::run_local(2, [&](dist::ProcessGroup& pg) {
      manual_seed(1);
      nn::GPT model(zero_config());
      dist::ShardedModel sharded(model, pg,
                                 {.stage = stage, .compute_dtype = DType::f32, .adamw = kAdamW});
      const auto train_step = [&](int s) {
        const auto [x, y] = global_batch(s);
        sharded.zero_grad();
        model.forward(x.narrow(0, 2 * pg.rank(), 2), y.narrow(0, 2 * pg.rank(), 2)).loss.backward();
        sharded.step(1e-2);
      };
      fn(pg, model, sharded, train_step);
    });
  };
  const auto evaluate = [](nn::GPT& model) {
    NoGradGuard no_grad;
    const auto [x, y] = global_batch(9);
    return model.forward(x, y).loss.item<double>();
  };
  nn::NamedTensors plain, summoned;  // the master weights after two steps
  double plain_loss = 0, summoned_loss = 0;
  int64_t plain_sent = 0;  // bytes rank 0 sent in a step: 2 gathers and a reduce-scatter of each unit, and a few numbers
  run(3, [&](dist::ProcessGroup& pg, nn::GPT& model, dist::ShardedModel& sharded, const auto& train_step) {
    pg.reset_bytes_sent();
    train_step(0);
    if (pg.rank() == 0) plain_sent = pg.bytes_sent();
    const double loss = evaluate(model);
    if (pg.rank() == 0) plain_loss = loss;
    train_step(1);
    keep_master(pg, sharded, 0, plain);
  });
  run(3, [&](dist::ProcessGroup& pg, nn::GPT& model, dist::ShardedModel& sharded, const auto& train_step) {
    train_step(0);
    {
      const auto full = sharded.summon_full_params();
      CHECK(memory_stats()[MemoryCategory::communication] == units);
      CHECK(max_difference(model.named_parameters(), sharded.gathered_master()) == 0);  // readable: the weights
      { const auto inner = sharded.summon_full_params(); }  // nested: the outer scope keeps them
      CHECK(memory_stats()[MemoryCategory::communication] == units);
      pg.reset_bytes_sent();
      const double loss = evaluate(model);
      CHECK(pg.bytes_sent() == 0);  // the evaluation gathered nothing
      if (pg.rank() == 0) summoned_loss = loss;
      // A step under the scope: the reduce-scatters, then each unit's new weights gathered
      // once (a plain step gathers each twice).
      train_step(1);
      if (pg.rank() == 0) CHECK(pg.bytes_sent() == plain_sent - units / 2);
      CHECK(memory_stats()[MemoryCategory::communication] == units);
      CHECK(max_difference(model.named_parameters(), sharded.gathered_master()) == 0);
    }
    CHECK(memory_stats()[MemoryCategory::communication] == 0);  // released at the scope's end
    keep_master(pg, sharded, 0, summoned);
  });
  CHECK(summoned_loss == plain_loss);
  CHECK(max_difference(summoned, plain) == 0);

  // A write to summoned weights would be lost: the next step refuses, on every rank (here
  // rank 1 wrote), until a load.
  run(3, [&](dist::ProcessGroup& pg, nn::GPT& model, dist::ShardedModel& sharded, const auto& train_step) {
    sharded.save(dir);
    {
      const auto full = sharded.summon_full_params();
      NoGradGuard no_grad;
      if (pg.rank() == 1) model.named_parameters().back().second.fill_(0.0);
    }
    CHECK_THROWS_WITH_AS(train_step(0), doctest::Contains("a different count of written parameters"), Error);
    sharded.load(dir);
    train_step(0);
  });
  CHECK_THROWS_WITH_AS(
      run(3,
          [&](dist::ProcessGroup&, nn::GPT& model, dist::ShardedModel& sharded, const auto& train_step) {
            const auto full = sharded.summon_full_params();
            {
              NoGradGuard no_grad;
              model.named_parameters().back().second.fill_(0.0);
            }
            train_step(0);  // still under the scope
          }),
      doctest::Contains("the full weights of summon_full_params() were written"), Error);
  // Stages 0-2 hold the full weights anyway: the scope gathers nothing.
  run(2, [&](dist::ProcessGroup& pg, nn::GPT&, dist::ShardedModel& sharded, const auto&) {
    pg.reset_bytes_sent();
    const auto full = sharded.summon_full_params();
    CHECK(pg.bytes_sent() == 0);
  });
  std::filesystem::remove_all(dir);
}

TEST_CASE("ZeRO-3 weights used outside the uses the plan names, or changed since: an error, not wrong gradients") {
  dist::FakeGroup group(0, 1);
  const auto [x, y] = global_batch(0);
  const std::string released = "was released (the full weights of ZeRO-3 unit 'root', gathered only around the uses "
                               "its UnitPlan names";
  const std::string read_released = "ShardedModel: the forward of 'transformer.wpe' reads the weights of ZeRO-3 unit "
                                    "'root' while they are released: the full weights of ZeRO-3 unit 'root'";
  {
    manual_seed(1);
    nn::GPT model(zero_config());
    dist::ShardedModel sharded(model, group, ZeroRun{.stage = 3}.config());
    const Tensor loss = model.forward(x, y).loss;
    loss.backward(Tensor(), /*retain_graph=*/true);
    CHECK_THROWS_WITH_AS(loss.backward(), doctest::Contains(released.c_str()), Error);
  }
  {  // A step between the forward and its backward: the re-gathered weights are not the
     // ones the forward used (was: gradients computed with them, silently).
    manual_seed(1);
    nn::GPT model(zero_config());
    dist::ShardedModel sharded(model, group, ZeroRun{.stage = 3}.config());
    model.forward(x, y).loss.backward();  // the gradients the step takes
    const Tensor loss = model.forward(x, y).loss;
    sharded.step(1e-3);
    CHECK_THROWS_WITH_AS(loss.backward(), doctest::Contains("modified in place"), Error);
  }
  nn::UnitPlan plan = nn::GPT(zero_config(), kMeta).unit_plan();
  plan.root_before = {"transformer.wte"};  // wpe's forward uses the root too
  {
    manual_seed(1);
    nn::GPT model(zero_config());
    dist::ShardedModel sharded(model, plan, group, ZeroRun{.stage = 3}.config());
    CHECK_THROWS_WITH_AS(model.forward(x, y), doctest::Contains(read_released.c_str()), Error);
  }
  // The blocks' ModuleList as one unit: its own forward never runs, so nothing gathers
  // it -- but a prefetch had started, and the blocks computed with weights it was still
  // writing (a loss that changed from run to run).
  for (int prefetch : {0, 1}) {
    INFO("prefetch " << prefetch);
    manual_seed(1);
    nn::GPT model(zero_config());
    nn::UnitPlan list_plan = model.unit_plan();
    list_plan.units = {"transformer.h"};
    dist::ShardedModel sharded(model, list_plan, group, ZeroRun{.stage = 3, .prefetch = prefetch}.config());
    const std::string state = prefetch ? "still being gathered (a prefetch is writing them)" : "released";
    CHECK_THROWS_WITH_AS(model.forward(x, y),
                         doctest::Contains(("ShardedModel: the forward of 'transformer.h.0.ln_1' reads the weights of "
                                            "ZeRO-3 unit 'transformer.h' while they are " + state).c_str()),
                         Error);
  }
}

TEST_CASE("ZeRO-3: a root parameter the root module reads, not named by the plan, is an error that says so") {
  struct Scaled : TwoLayers {
    Tensor scale = register_parameter("scale", ones({4}, DType::f64));
    Tensor forward(const Tensor& x) override { return (*b)(gelu((*a)(x)) * scale); }
  };
  dist::FakeGroup group(0, 1);
  Scaled model;
  dist::ShardedModel sharded(model, {.units = {"b"}, .root_before = {"a"}}, group,
                             {.stage = 3, .compute_dtype = DType::f64, .adamw = kAdamW});
  CHECK_THROWS_WITH_AS(model(ones({2, 3}, DType::f64)),
                       doctest::Contains("the forward of the root module reads the weights of ZeRO-3 unit 'root'"),
                       Error);
}

TEST_CASE("ZeRO-3: ranks that run units of one size in different orders get an error, not each other's weights") {
  // Each unit's collectives carry its tag: before, the gathers of two same-sized units
  // paired rank 0's first with rank 1's second (0.05 off, silently).
  CHECK_THROWS_WITH_AS(dist::run_local(2,
                                       [](dist::ProcessGroup& pg) {
                                         manual_seed(1);
                                         struct Twins : nn::Module {  // two units of 6 parameters each
                                           std::shared_ptr<nn::Linear> p = register_module(
                                               "p", std::make_shared<nn::Linear>(2, 2, true, 0.5, TensorOptions(DType::f64)));
                                           std::shared_ptr<nn::Linear> q = register_module(
                                               "q", std::make_shared<nn::Linear>(2, 2, true, 0.5, TensorOptions(DType::f64)));
                                         } model;
                                         dist::ShardedModel sharded(model, {.units = {"p", "q"}}, pg,
                                                                    {.stage = 3, .compute_dtype = DType::f64, .prefetch = 0});
                                         const Tensor x = ones({1, 2}, DType::f64);
                                         if (pg.rank() == 0) (*model.p)((*model.q)(x));
                                         else (*model.q)((*model.p)(x));
                                       }),
                       doctest::Contains("rank 0 called all_gather(f64[3] on cpu -> f64[6] on cpu, tag 2), rank 1 called "
                                         "all_gather(f64[3] on cpu -> f64[6] on cpu, tag 1)"),
                       Error);
}

TEST_CASE("ZeRO-3 keep_after_forward: 2Ψ elements of traffic for kept units, the same weights; prefetch_bytes bounds prefetch") {
  // Dry runs of GPT-2 124M, rank 0 of 4: bytes sent, the peak of gathered weights, Ψ.
  auto dry = [&](dist::ZeroConfig config) {
    config.stage = 3, config.compute_dtype = DType::bf16, config.adamw = kAdamW;
    return dry_run_gpt2_step(config);
  };
  const auto [sent, peak, psi] = dry({});
  const auto [sent_kept, peak_kept, psi_kept] = dry({.keep_after_forward = {"*"}});
  CHECK(std::abs(sent_kept / (2.0 * psi * 2 * 3 / 4) - 1) < 0.01);  // 2Ψ bf16 elements, ring-counted at N = 4
  CHECK(std::abs(sent / (3.0 * psi * 2 * 3 / 4) - 1) < 0.01);
  CHECK(peak_kept > peak);  // every block held from its forward to its backward
  // A bound below one block's weights prefetches nothing: prefetch 0's peak.
  const auto [sent_none, peak_none, psi_none] = dry({.prefetch = 0});
  const auto [sent_bound, peak_bound, psi_bound] = dry({.prefetch = 2, .prefetch_bytes = 1});
  const auto [sent_two, peak_two, psi_two] = dry({.prefetch = 2});
  CHECK(peak_bound == peak_none);
  CHECK(peak_two > peak_none);
  CHECK(sent_bound == sent_two);  // what is gathered, not when

  // Real steps at N = 2 in bf16: the same bits whichever units are kept and however far prefetch goes.
  auto train = [](dist::ZeroConfig config) {
    nn::NamedTensors kept;
    config.stage = 3, config.compute_dtype = DType::bf16, config.adamw = kAdamW;  // before the ranks read it
    dist::run_local(2, [&](dist::ProcessGroup& pg) {
      manual_seed(1);
      nn::GPT model(zero_config());
      dist::ShardedModel sharded(model, pg, config);
      for (int s = 0; s < 3; ++s) {
        const auto [x, y] = global_batch(s);
        sharded.zero_grad();
        model.forward(x.narrow(0, 2 * pg.rank(), 2), y.narrow(0, 2 * pg.rank(), 2)).loss.backward();
        sharded.step(1e-3);
      }
      const nn::NamedTensors master = sharded.gathered_master();
      if (pg.rank() == 0) kept = master;
    });
    return kept;
  };
  const nn::NamedTensors reference = train({});
  for (const dist::ZeroConfig& config : {dist::ZeroConfig{.keep_after_forward = {"root", "transformer.h.1"}},
                                         dist::ZeroConfig{.keep_after_forward = {"*"}},
                                         dist::ZeroConfig{.prefetch = 2, .prefetch_bytes = 1}})
    CHECK(max_difference(train(config), reference) == 0.0);

  dist::SingleRank one;
  nn::GPT model(zero_config());
  CHECK_THROWS_WITH_AS(dist::ShardedModel(model, one, {.stage = 3, .keep_after_forward = {"transformer.h.9"}}),
                       doctest::Contains("keep_after_forward names unit 'transformer.h.9', which the plan does not have "
                                         "(units: 'root', 'transformer.h.0', 'transformer.h.1'"),
                       Error);
  CHECK_THROWS_WITH_AS(dist::ShardedModel(model, one, {.stage = 2, .keep_after_forward = {"*"}}),
                       doctest::Contains("keep_after_forward is for stage 3"), Error);
}

TEST_CASE("ZeRO-3 qwZ (quantize_weights): int8 gathers send 1 + 4/2048 bytes an element instead of bf16's 2; "
          "summon_full_params gathers exactly, even units a forward left gathered quantized") {
  // Dry runs of GPT-2 124M, rank 0 of 4: one step gathers each unit twice and reduce-scatters it once.
  const auto [plain, plain_peak, psi] = dry_run_gpt2_step({.stage = 3, .compute_dtype = DType::bf16});
  const auto [quantized, quantized_peak, psi_q] =
      dry_run_gpt2_step({.stage = 3, .compute_dtype = DType::bf16, .quantize_weights = true});
  const double ring = 3.0 / 4;  // (N - 1) / N
  CHECK(std::abs(plain / (3 * 2 * psi * ring) - 1) < 0.01);
  CHECK(std::abs(quantized / ((2 * (1 + 4.0 / kQuantizationBlock) + 2) * psi * ring) - 1) < 0.01);

  // A step at N = 2 in f32, then a forward without grad, which leaves its last unit (the
  // head's) gathered, quantized: summon_full_params() gathers it again, exactly.
  dist::run_local(2, [&](dist::ProcessGroup& pg) {
    manual_seed(1);
    nn::GPT model(zero_config());
    dist::ShardedModel sharded(model, pg, {.stage = 3, .quantize_weights = true});
    const auto [x, y] = global_batch(0);
    sharded.zero_grad();
    model.forward(x.narrow(0, 2 * pg.rank(), 2), y.narrow(0, 2 * pg.rank(), 2)).loss.backward();
    sharded.step(1e-3);
    {
      NoGradGuard no_grad;
      model.forward(x.narrow(0, 2 * pg.rank(), 2), y.narrow(0, 2 * pg.rank(), 2));
    }
    const nn::NamedTensors master = sharded.gathered_master();
    const auto full = sharded.summon_full_params();
    for (const auto& [name, p] : model.named_parameters()) {
      const std::string parameter = name;  // (Clang: INFO cannot capture a structured binding)
      INFO(parameter);
      for (const auto& [n, m] : master)
        if (n == parameter) CHECK(max_abs_diff(p, m) == 0.0);
    }
  });
  CHECK_THROWS_WITH_AS(dist::ShardedModel(*std::make_unique<nn::GPT>(zero_config()), *std::make_unique<dist::FakeGroup>(0, 2),
                                          {.stage = 2, .quantize_weights = true}),
                       doctest::Contains("quantize_weights (qwZ) quantizes ZeRO-3's weight all-gathers; stage 2"), Error);
}

}  // namespace zg::test
