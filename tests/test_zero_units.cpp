// Units: the planner alone (no rank, no allocation), and a unit used more than once in one
// step -- a siamese loss, net(x) and net(y) -- at every stage.
#include <doctest/doctest.h>

#include <mutex>
#include <set>

#include "dist/comm/local_group.h"
#include "dist/zero/planner.h"
#include "nn/layers.h"
#include "zero_training.h"

namespace zg::test {

namespace {

dist::PlannerInput planner_input(nn::Module& model, const dist::ZeroConfig& config, int shard_ranks) {
  return {.parameters = model.named_parameters(),
          .aliases = model.named_parameters(/*remove_duplicates=*/false),
          .modules = model.named_modules(),
          .plan = model.unit_plan(),
          .config = config,
          .shard_ranks = shard_ranks};
}

}  // namespace

TEST_CASE("the planner alone: units, packing, padding, groups and frozen parameters, and its refusals") {
  manual_seed(1);
  nn::GPT model(zero_config());
  const dist::ShardingPlan plan = dist::plan_sharding(planner_input(model, {.stage = 3}, 4));
  REQUIRE(plan.units.size() == 3);
  CHECK(plan.units[0].name == "root");
  CHECK(plan.units[1].name == "transformer.h.0");
  CHECK(plan.units[2].name == "transformer.h.1");
  CHECK((plan.units[0].module == nullptr && plan.units[1].module != nullptr));
  CHECK(plan.root_gathered);
  std::set<std::string> placed;
  for (size_t u = 0; u < plan.units.size(); ++u) {
    const dist::UnitSpec& unit = plan.units[u];
    INFO("unit " << unit.name);
    CHECK(unit.tag == static_cast<int64_t>(u) + 1);
    CHECK(unit.padded % 4 == 0);
    CHECK(unit.padded - unit.numel < 4);
    CHECK(unit.shard * 4 == unit.padded);
    // Packed end to end, matrices (decayed) before vectors, each range one (group, decay).
    int64_t offset = 0;
    for (const dist::ParamSlot& slot : unit.entries) {
      CHECK(slot.offset == offset);
      offset += numel(slot.shape);
      CHECK(placed.insert(slot.name).second);
    }
    CHECK(offset == unit.numel);
    REQUIRE(unit.update_ranges.size() == 2);
    CHECK((unit.update_ranges[0].decay && !unit.update_ranges[1].decay));
    CHECK((unit.update_ranges[0].begin == 0 && unit.update_ranges[1].end == unit.numel &&
           unit.update_ranges[0].end == unit.update_ranges[1].begin));
  }
  CHECK(placed.size() == model.named_parameters().size());
  CHECK(model.named_parameters().front().second.storage() != nullptr);  // nothing moved: the planner only reads
  CHECK(ParameterOwner::of(model.named_parameters().front().second) == nullptr);

  // A parameter group makes ranges of its own, with its lr scale.
  dist::ZeroConfig grouped{.stage = 1, .adamw = {.groups = {{.names = {"*.attn.*"}, .lr_scale = 0.5}}}};
  const dist::ShardingPlan groups = dist::plan_sharding(planner_input(model, grouped, 2));
  bool scaled = false;
  for (const dist::UpdateRange& range : groups.units[1].update_ranges) scaled = scaled || range.lr_scale == 0.5;
  CHECK(scaled);
  for (const dist::UpdateRange& range : groups.units[0].update_ranges) CHECK(range.lr_scale == 1.0);

  // A frozen parameter: replicated at stages 0-2, sharded with its unit at 3.
  model.named_parameters()[0].second.set_requires_grad(false);
  const std::string frozen = model.named_parameters()[0].first;
  CHECK(dist::plan_sharding(planner_input(model, {.stage = 2}, 2)).replicated_frozen.front().first == frozen);
  const dist::ShardingPlan stage3 = dist::plan_sharding(planner_input(model, {.stage = 3}, 2));
  CHECK(stage3.replicated_frozen.empty());
  CHECK(stage3.units[0].frozen_entries.front().name == frozen);
  CHECK(stage3.units[0].frozen_padded % 2 == 0);
  model.named_parameters()[0].second.set_requires_grad(true);

  dist::PlannerInput bad = planner_input(model, {.stage = 3}, 2);
  bad.plan.units.push_back("no.such.block");
  CHECK_THROWS_WITH_AS(dist::plan_sharding(bad), "ShardedModel: the model has no submodule 'no.such.block'", Error);
  bad = planner_input(model, {.stage = 3}, 2);
  bad.plan.units.push_back(bad.plan.units.front());
  CHECK_THROWS_WITH_AS(dist::plan_sharding(bad),
                       doctest::Contains("ShardedModel: the plan lists unit 'transformer.h.0' twice"), Error);
  bad = planner_input(model, {.stage = 3, .keep_after_forward = {"transformer.h.9"}}, 2);
  CHECK_THROWS_WITH_AS(dist::plan_sharding(bad), doctest::Contains("keep_after_forward names unit 'transformer.h.9'"),
                       Error);
  bad = planner_input(model, {.stage = 0, .adamw = {.groups = {{.names = {"nothing.*"}}}}}, 1);
  CHECK_THROWS_WITH_AS(dist::plan_sharding(bad), doctest::Contains("AdamW parameter group 0 ('nothing.*') matches no"),
                       Error);
}

namespace {

// Three layers, each a unit of its own; the root holds nothing.
struct Tower : nn::Module {
  std::shared_ptr<nn::Linear> fc1, fc2, fc3;
  Tower() {
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(4, 8, true, 0.5));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(8, 8, true, 0.5));
    fc3 = register_module("fc3", std::make_shared<nn::Linear>(8, 3, true, 0.5));
  }
  Tensor forward(const Tensor& x) override { return (*fc3)(gelu((*fc2)(gelu((*fc1)(x))))); }
  nn::UnitPlan unit_plan() const override { return {.units = {"fc1", "fc2", "fc3"}}; }
};

// Four steps of a siamese loss, mean over pairs of <net(x), net(y)>, on this rank's rows
// of 8 pairs: the master weights, and each step's loss summed over ranks.
std::pair<nn::NamedTensors, std::vector<double>> siamese_run(int n, int stage, bool checkpoint_check = false) {
  nn::NamedTensors weights;
  std::vector<double> losses(4, 0.0);
  std::mutex mutex;
  dist::run_local(n, [&](dist::ProcessGroup& pg) {
    manual_seed(3);
    Tower net;
    dist::ShardedModel sharded(net, pg, {.stage = stage, .compute_dtype = DType::f64, .adamw = kAdamW});
    const int64_t rows = 8 / n;
    for (int s = 0; s < 4; ++s) {
      Context scratch;
      Tensor x, y;
      {
        ContextGuard guard(scratch);
        manual_seed(50 + s);
        x = randn({8, 4}, DType::f64), y = randn({8, 4}, DType::f64);
      }
      sharded.zero_grad();
      const Tensor a = net(x.narrow(0, pg.rank() * rows, rows)), b = net(y.narrow(0, pg.rank() * rows, rows));
      const Tensor loss = sum(a * b) * (1.0 / rows);
      loss.backward();
      if (checkpoint_check && stage == 3)  // the backward's end left no unit gathered and no reduction buffer
        CHECK(memory_stats(kCPU)[MemoryCategory::communication] == 0);
      sharded.step(1e-2);
      std::lock_guard lock(mutex);
      losses[static_cast<size_t>(s)] += loss.item<double>() / n;
    }
    const nn::NamedTensors master = sharded.gathered_master();
    if (pg.rank() == 0) weights = master;
  });
  return {weights, losses};
}

}  // namespace

TEST_CASE("a siamese loss (a unit used twice in a step) trains at every stage, per-layer units, N = 1 and 2, as stage 0") {
  const auto [reference, reference_losses] = siamese_run(1, 0);
  for (int n : {1, 2})
    for (int stage : {0, 1, 2, 3}) {
      INFO("N = " << n << ", stage " << stage);
      const auto [weights, losses] = siamese_run(n, stage, true);
      REQUIRE(weights.size() == reference.size());
      for (size_t i = 0; i < weights.size(); ++i) {
        const std::vector<double> got = weights[i].second.to_vector<double>();
        const std::vector<double> want = reference[i].second.to_vector<double>();
        REQUIRE(got.size() == want.size());
        for (size_t k = 0; k < got.size(); ++k) CHECK(got[k] == doctest::Approx(want[k]).epsilon(1e-12));
      }
      for (size_t s = 0; s < losses.size(); ++s) CHECK(losses[s] == doctest::Approx(reference_losses[s]).epsilon(1e-12));
    }
}

}  // namespace zg::test

namespace zg::test {

TEST_CASE("ranks whose plans differ are all told which rank's plan failed, before any collective of the model") {
  dist::run_local(2, [](dist::ProcessGroup& pg) {
    manual_seed(1);
    nn::GPT model(zero_config());
    nn::UnitPlan plan = model.unit_plan();
    if (pg.rank() == 1) plan.root_after = {"no.such.norm"};  // checked by ZeRO-3's gather scheduler
    if (pg.rank() == 1)
      CHECK_THROWS_WITH_AS(dist::ShardedModel(model, plan, pg, {.stage = 3}),
                           "ShardedModel: the model has no submodule 'no.such.norm'", Error);
    else
      CHECK_THROWS_WITH_AS(dist::ShardedModel(model, plan, pg, {.stage = 3}),
                           doctest::Contains("rank 1 failed: ShardedModel: the model has no submodule 'no.such.norm'"),
                           Error);
    CHECK(ParameterOwner::of(model.named_parameters().front().second) == nullptr);  // nothing moved
  });
}

}  // namespace zg::test
