// Task 2 (docs/tasks/README.md): a model of your own with a unit plan -- each residual
// block a unit, the input projection and the head in the root unit around them -- trained
// with ZeRO-3 on 2 ranks, and checked against the same model trained on one rank.
#include <cmath>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>

#include "dist/comm/fake_group.h"
#include "dist/comm/local_group.h"
#include "dist/zero/planner.h"
#include "dist/zero/sharded_model.h"
#include "nn/layers.h"
#include "zerograd.h"

using namespace zg;

namespace {

// x + fc2(silu(fc1(norm(x)))): a pre-norm residual MLP block.
struct Block : nn::Module {
  std::shared_ptr<nn::RMSNorm> norm;
  std::shared_ptr<nn::Linear> fc1, fc2;
  explicit Block(int64_t width) {
    norm = register_module("norm", std::make_shared<nn::RMSNorm>(width));
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(width, 4 * width, true, 0.1));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(4 * width, width, true, 0.1));
  }
  Tensor forward(const Tensor& x) override { return x + (*fc2)(silu((*fc1)((*norm)(x)))); }
};

struct ResidualMLP : nn::Module {
  std::shared_ptr<nn::Linear> embed, head;
  std::shared_ptr<nn::ModuleList> blocks;
  ResidualMLP(int64_t in, int64_t width, int depth, int64_t out) {
    embed = register_module("embed", std::make_shared<nn::Linear>(in, width, true, 0.1));
    blocks = register_module("blocks", std::make_shared<nn::ModuleList>());
    for (int i = 0; i < depth; ++i) blocks->push_back(std::make_shared<Block>(width));
    head = register_module("head", std::make_shared<nn::Linear>(width, out, true, 0.1));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = (*embed)(x);
    for (size_t i = 0; i < blocks->size(); ++i) h = (*blocks)[i](h);
    return (*head)(h);
  }
  // The answer: a unit per block, in forward order; the rest (embed, head) is the root,
  // which ZeRO-3 gathers around the modules that use it -- before the blocks and after.
  nn::UnitPlan unit_plan() const override {
    nn::UnitPlan plan{.root_before = {"embed"}, .root_after = {"head"}};
    for (size_t i = 0; i < blocks->size(); ++i) plan.units.push_back("blocks." + std::to_string(i));
    return plan;
  }
};

constexpr int kDepth = 4, kSteps = 5;
constexpr int64_t kRows = 16;

struct Run {
  std::vector<double> losses;  // each step's loss over the whole batch
  nn::NamedTensors master;     // the trained weights, gathered
};

// kSteps of AdamW on a regression target, each rank on its kRows / N rows of the batch.
Run train(int n, int stage) {
  Run run{.losses = std::vector<double>(kSteps, 0.0), .master = {}};
  std::mutex mutex;
  dist::run_local(n, [&](dist::ProcessGroup& pg) {
    manual_seed(7);  // the same weights on every rank (and ShardedModel broadcasts rank 0's)
    ResidualMLP model(3, 16, kDepth, 2);
    dist::ShardedModel sharded(model, pg, {.stage = stage, .compute_dtype = DType::f64});
    const Tensor x = randn({kRows, 3}, DType::f64);
    const Tensor y = cat({sin(x.narrow(1, 0, 1)), x.narrow(1, 1, 1) * x.narrow(1, 2, 1)}, 1);
    const int64_t rows = kRows / n, first = pg.rank() * rows;
    for (int s = 0; s < kSteps; ++s) {
      sharded.zero_grad();
      const Tensor loss = mse_loss(model(x.narrow(0, first, rows)), y.narrow(0, first, rows));
      loss.backward();
      sharded.step(1e-2);
      std::lock_guard lock(mutex);
      run.losses[static_cast<size_t>(s)] += loss.item<double>() / n;  // the mean over ranks: the batch's loss
    }
    const nn::NamedTensors master = sharded.gathered_master();
    if (pg.rank() == 0) run.master = master;
  });
  return run;
}

}  // namespace

int main() {
  // The units the plan gives, as the ShardedModel will build them (the planner alone: nothing moves).
  manual_seed(7);
  ResidualMLP model(3, 16, kDepth, 2);
  const dist::ShardingPlan plan = dist::plan_sharding({.parameters = model.named_parameters(),
                                                       .aliases = model.named_parameters(false),
                                                       .modules = model.named_modules(),
                                                       .plan = model.unit_plan(),
                                                       .config = {.stage = 3},
                                                       .shard_ranks = 2});
  std::printf("%zu units:", plan.units.size());
  for (const dist::UnitSpec& unit : plan.units) std::printf(" %s (%lld)", unit.name.c_str(), (long long)unit.numel);
  std::printf("\n");

  const Run one = train(1, 0), sharded = train(2, 3);
  double worst = 0;  // the largest difference between the two runs, relative
  for (size_t s = 0; s < one.losses.size(); ++s) {
    std::printf("step %zu: loss %.6f on 1 rank, %.6f on 2 ranks at ZeRO-3\n", s + 1, one.losses[s], sharded.losses[s]);
    worst = std::max(worst, std::fabs(one.losses[s] - sharded.losses[s]) / one.losses[s]);
  }
  for (size_t i = 0; i < one.master.size(); ++i)
    worst = std::max(worst, max(abs(one.master[i].second - sharded.master[i].second)).item<double>());
  const bool same = plan.units.size() == size_t{kDepth} + 1 && worst < 1e-12;
  std::printf("%s\n", same ? "the same training as one rank" : "the runs differ");
  return same ? 0 : 1;
}
