// ZeRO's ranks agree or stop together: rank 0's weights on every rank, the same settings,
// lr and loss scale, an inf gradient skipped everywhere, a failing rank ends the others;
// and misuse (a bad plan or config, written weights, an unsynced step) is a clear error.
#include "dist/comm/fake_group.h"
#include "dist/comm/local_group.h"
#include "dist/zero/sharded_model.h"
#include "zero_cases.h"
#include "zero_training.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

namespace zg::test {

TEST_CASE("step() after a backward whose gradients were never reduced is refused, at every stage") {
  for (int stage : {0, 1, 2, 3}) {
    INFO("stage " << stage);
    CHECK_THROWS_WITH_AS(dist::run_local(2,
                                         [&](dist::ProcessGroup& pg) {
                                           manual_seed(1);
                                           nn::GPT model(zero_config());
                                           dist::ShardedModel sharded(model, pg,
                                                                      ZeroRun{.stage = stage}.config());
                                           const auto [x, y] = global_batch(0);
                                           sharded.set_gradient_sync(false);
                                           model.forward(x, y).loss.backward();
                                           sharded.step(1e-3);
                                         }),
                         doctest::Contains("step() after a backward with gradient sync off"), Error);
  }
}

TEST_CASE("every rank must step with the same lr and loss scale: a difference is refused on all of them") {
  std::atomic<int> refused{0};
  dist::run_local(2, [&](dist::ProcessGroup& pg) {
    manual_seed(1);
    nn::GPT model(zero_config());
    dist::ShardedModel sharded(model, pg, ZeroRun{.stage = 1}.config());
    const auto [x, y] = global_batch(0);
    model.forward(x, y).loss.backward();
    const auto snapshot = [&] {
      nn::NamedTensors copy;
      for (const auto& [name, t] : sharded.gathered_master()) copy.emplace_back(name, t.clone());
      return copy;
    };
    const nn::NamedTensors before = snapshot();
    optim::GradScaler scaler({.init_scale = pg.rank() == 0 ? 1024.0 : 2048.0});
    for (const auto& [step, message] : std::vector<std::pair<std::function<void()>, const char*>>{
             {[&] { sharded.step(pg.rank() == 0 ? 1e-3 : 2e-3); }, "different lr on some ranks (from 0.001 to 0.002)"},
             // A cosine schedule one step apart: a difference of 3e-5 relative.
             {[&] { sharded.step(pg.rank() == 0 ? 3e-4 : 3e-4 * (1 + 3e-5)); },
              "different lr on some ranks (from 3e-04 to 0.00030000899999999995)"},
             {[&] { sharded.step(1e-3, &scaler); }, "different loss scale on some ranks (from 1024 to 2048)"}}) {
      try {
        step();
      } catch (const Error& e) {
        CHECK_MESSAGE(std::string(e.what()).find(message) != std::string::npos, std::string(e.what()));
        ++refused;
      }
    }
    CHECK(max_difference(snapshot(), before) == 0);  // refused before any update
    CHECK(scaler.scale_factor() == (pg.rank() == 0 ? 1024.0 : 2048.0));
    sharded.step(1e-3);
    CHECK(max_difference(snapshot(), before) > 0);
  });
  CHECK(refused == 6);
}

TEST_CASE("bf16: a parameter written in place since the last step is refused on every rank, not overwritten") {
  for (int stage = 0; stage <= 2; ++stage) {
    std::atomic<int> refused{0};
    dist::run_local(2, [&](dist::ProcessGroup& pg) {
      manual_seed(1);
      nn::GPT model(zero_config());
      dist::ShardedModel sharded(model, pg, ZeroRun{.dtype = DType::bf16, .stage = stage}.config());
      const std::pair<Tensor, Tensor> batch = global_batch(0);
      const auto train = [&] {
        model.forward(batch.first, batch.second).loss.backward();
        sharded.step(1e-3);
      };
      train();  // the step's own writes are not the user's
      const Tensor wpe = model.named_parameters()[1].second;
      for (const bool both : {false, true}) {
        if (both || pg.rank() == 0) {
          NoGradGuard no_grad;
          wpe.narrow(0, 0, 1).fill_(0.5);
        }
        try {
          train();
        } catch (const Error& e) {
          const std::string message = both ? "compute weights were written since the last step"
                                           : "different count of written parameters";
          CHECK_MESSAGE(std::string(e.what()).find(message) != std::string::npos, std::string(e.what()));
          ++refused;
        }
      }
    });
    CHECK(refused == 4);
  }
}

TEST_CASE("every rank starts from rank 0's weights, and ranks built with different settings are refused") {
  // Before (found by fuzzing): ranks seeded apart trained a mix of their initial weights
  // (ZeRO) or drifted apart (DDP), and a different weight decay or clipping norm per rank
  // made DDP replicas drift apart, without a word.
  for (int stage = 0; stage <= 3; ++stage)
    dist::run_local(2, [&](dist::ProcessGroup& pg) {
      manual_seed(1);
      nn::GPT reference(zero_config());
      manual_seed(1 + pg.rank());
      nn::GPT model(zero_config());
      dist::ShardedModel sharded(model, pg, {.stage = stage, .compute_dtype = DType::f32});
      CHECK(max_difference(sharded.gathered_master(), reference.named_parameters()) == 0);
    });
  CHECK_THROWS_WITH_AS(dist::run_local(2,
                                       [&](dist::ProcessGroup& pg) {
                                         manual_seed(1);
                                         nn::GPT model(zero_config());
                                         dist::ShardedModel sharded(
                                             model, pg,
                                             {.compute_dtype = DType::f32, .max_grad_norm = pg.rank() == 0 ? 0.0 : 1.0});
                                       }),
                       doctest::Contains("ShardedModel: was built with a different ZeroConfig::max_grad_norm on some "
                                         "ranks (from 0 to 1); every rank must pass the same"),
                       Error);
  // Enums by name: before, "from 1 to 3".
  CHECK_THROWS_WITH_AS(dist::run_local(2,
                                       [&](dist::ProcessGroup& pg) {
                                         manual_seed(1);
                                         nn::GPT model(zero_config());
                                         dist::ShardedModel sharded(
                                             model, pg, {.compute_dtype = pg.rank() == 0 ? DType::f32 : DType::bf16});
                                       }),
                       doctest::Contains("ShardedModel: was built with a different ZeroConfig::compute_dtype on some "
                                         "ranks (from f32 to bf16); every rank must pass the same"),
                       Error);
  // Rank 1 plans its units otherwise: the collectives would pair unit u of one rank with
  // a different unit u of the other.
  const auto refused_plan = [](const std::function<void(nn::UnitPlan&)>& on_rank_1, const std::string& error) {
    CHECK_THROWS_WITH_AS(dist::run_local(2,
                                         [&](dist::ProcessGroup& pg) {
                                           manual_seed(1);
                                           nn::GPT model(zero_config());
                                           nn::UnitPlan plan = model.unit_plan();
                                           if (pg.rank() == 1) on_rank_1(plan);
                                           dist::ShardedModel sharded(model, plan, pg, {.stage = 3, .compute_dtype = DType::f32});
                                         }),
                         doctest::Contains(("ShardedModel: was built with a different " + error).c_str()), Error);
  };
  // The same number of units and elements, split differently: buffers of different
  // sizes, which NCCL does not check.
  refused_plan([](nn::UnitPlan& plan) { plan.units[0] += ".attn"; },  // the rest of h.0 in the root
               "size of unit root on some ranks");
  // Equal-sized units listed in another order: layer 1 would have trained on layer 0's gradients.
  refused_plan([](nn::UnitPlan& plan) { std::swap(plan.units[0], plan.units[1]); },
               "parameter names and shapes (hashed) of unit transformer.h.");
  // A rank whose own checks refuse its config still meets the others (else they would
  // wait for it in the agreement until the group's timeout, or for ever under mpi).
  std::string rank0_error;
  CHECK_THROWS_AS(dist::run_local(2,
                                       [&](dist::ProcessGroup& pg) {
                                         manual_seed(1);
                                         nn::GPT model(zero_config());
                                         try {
                                           dist::ShardedModel sharded(
                                               model, pg,
                                               {.compute_dtype = DType::f32, .max_grad_norm = pg.rank() == 1 ? -1.0 : 0.0});
                                         } catch (const Error& e) {
                                           if (pg.rank() == 0) rank0_error = e.what();
                                           throw;
                                         }
                                       }),
                       Error);
  // Rank 0 says why rank 1 failed.
  CHECK(rank0_error == "ShardedModel: rank 1 failed: ShardedModel: max_grad_norm must be >= 0 and finite (0 disables "
                       "clipping), got -1");
}

TEST_CASE("a rank that fails in the middle of a sharded backward ends the others with its error") {
  using namespace std::chrono_literals;
  for (int stage : {0, 3}) {
    INFO("stage " << stage);
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH_AS(dist::run_local(
                             2,
                             [&](dist::ProcessGroup& pg) {
                               manual_seed(1);
                               nn::GPT model(zero_config());
                               dist::ShardedModel sharded(model, pg,
                                                          {.stage = stage, .compute_dtype = DType::f32});
                               if (pg.rank() == 1)  // fails as the backward reaches block 0
                                 (*model.h)[0].register_forward_hook([](nn::Module&, const Tensor&, const Tensor& out) {
                                   out.register_hook([](const Tensor&) -> Tensor { throw Error("bad batch on rank 1"); });
                                   return Tensor();
                                 });
                               const auto [x, y] = global_batch(0);
                               sharded.zero_grad();
                               model.forward(x.narrow(0, 2 * pg.rank(), 2), y.narrow(0, 2 * pg.rank(), 2)).loss.backward();
                               sharded.step(1e-3);
                             },
                             {30s}),
                         "rank 1: bad batch on rank 1", Error);
    CHECK(std::chrono::steady_clock::now() - start < 10s);  // woken by the failure, not the timeout
  }
}

TEST_CASE("an inf gradient on one rank makes every rank skip the step and back off its loss scale") {
  for (int stage = 0; stage <= 3; ++stage) {
    INFO("stage " << stage);
    std::vector<double> scales(2);
    std::vector<char> stepped(2);  // not vector<bool>: its ranks' bits share a word both threads write
    std::vector<double> moved(2);
    dist::run_local(2, [&](dist::ProcessGroup& pg) {
      manual_seed(1);
      nn::GPT model(zero_config());
      dist::ShardedModel sharded(model, pg, {.stage = stage, .compute_dtype = DType::f16});
      optim::GradScaler scaler({.init_scale = 1024.0});
      const nn::NamedTensors before = sharded.gathered_master();
      std::vector<Tensor> copies;
      for (const auto& [name, t] : before) copies.push_back(t.clone());
      const auto [x, y] = global_batch(0);
      sharded.zero_grad();
      Tensor loss = scaler.scale(model.forward(x.narrow(0, 2 * pg.rank(), 2), y.narrow(0, 2 * pg.rank(), 2)).loss);
      if (pg.rank() == 1) loss = loss * 1e30;  // overflows f16 gradients on this rank only
      loss.backward();
      const dist::StepResult result = sharded.step(1e-3, &scaler);
      stepped[pg.rank()] = result.stepped;
      scales[pg.rank()] = scaler.scale_factor();
      double change = 0;
      const nn::NamedTensors after = sharded.gathered_master();
      for (size_t i = 0; i < after.size(); ++i)
        change = std::max(change, max(abs(after[i].second - copies[i])).item<double>());
      moved[pg.rank()] = change;
    });
    CHECK(stepped == std::vector<char>{false, false});
    CHECK(scales == std::vector<double>{512.0, 512.0});
    CHECK(moved == std::vector<double>{0.0, 0.0});
  }
}

TEST_CASE("a bad plan or config is a clear error naming what is wrong") {
  dist::FakeGroup group(0, 2);
  manual_seed(1);
  nn::GPT model(zero_config(), kMeta);
  const auto make = [&](nn::UnitPlan plan, dist::ZeroConfig config) { dist::ShardedModel(model, plan, group, config); };
  CHECK_THROWS_WITH_AS(make({.units = {"transformer.h.7"}}, {}), "ShardedModel: the model has no submodule 'transformer.h.7'",
                       Error);
  // Listed twice, or a unit inside another listed first: both said the unit "has no
  // parameters" (the later match took them). A unit inside another now takes its own.
  CHECK_THROWS_WITH_AS(make({.units = {"transformer.h.0", "transformer.h.0"}}, {}),
                       "ShardedModel: the plan lists unit 'transformer.h.0' twice", Error);
  for (const std::vector<std::string>& units : {std::vector<std::string>{"transformer.h.0.attn", "transformer.h.0"},
                                                std::vector<std::string>{"transformer.h.0", "transformer.h.0.attn"}}) {
    nn::GPT nested(zero_config(), kMeta);
    dist::ShardedModel sharded(nested, {.units = units}, group, {});
    const nn::NamedTensors gathered = sharded.gathered_master();
    CHECK(gathered.size() == nested.named_parameters().size());
  }
  const Tensor wte = model.named_parameters().front().second;
  const auto wte_storage = wte.storage();
  CHECK_THROWS_WITH_AS(make({.units = {}, .root_before = {"transformer.wtf"}}, {.stage = 3}),
                       "ShardedModel: the model has no submodule 'transformer.wtf'", Error);
  CHECK(wte.storage() == wte_storage);  // a refused plan left the parameters where they were (was: moved into freed buffers)
  CHECK_THROWS_WITH_AS(make(model.unit_plan(), {.stage = 4}), "ShardedModel: stage must be 0, 1, 2 or 3, got 4", Error);
  CHECK_THROWS_WITH_AS(make(model.unit_plan(), {.compute_dtype = DType::i32}),
                       "ShardedModel: compute dtype must be floating, got i32", Error);
  CHECK_THROWS_WITH_AS(make(model.unit_plan(), {.reduce_dtype = DType::boolean}),
                       "ShardedModel: reduce dtype must be floating, got bool", Error);
  CHECK_THROWS_WITH_AS(make(model.unit_plan(), {.bucket_bytes = 0}), "ShardedModel: bucket_bytes must be positive, got 0",
                       Error);
  CHECK_THROWS_WITH_AS(make(model.unit_plan(), {.prefetch = -1}), "ShardedModel: prefetch must be >= 0, got -1", Error);
  // A NaN or negative clip silently disabled clipping.
  CHECK_THROWS_WITH_AS(make(model.unit_plan(), {.max_grad_norm = NAN}),
                       "ShardedModel: max_grad_norm must be >= 0 and finite (0 disables clipping), got nan", Error);
  CHECK_THROWS_WITH_AS(make(model.unit_plan(), {.max_grad_norm = -1}), doctest::Contains("got -1"), Error);
  CHECK_THROWS_WITH_AS(make(model.unit_plan(), {.adamw = {.eps = 0}}), doctest::Contains("AdamW: eps must be positive"),
                       Error);
  // Parameters another ShardedModel already holds in its buffers.
  {
    dist::ShardedModel first(model, group, {.stage = 1});
    CHECK_THROWS_WITH_AS(make(model.unit_plan(), {.stage = 2}),
                         "ShardedModel: parameter 'transformer.wte.weight' already lives in the flat buffers of a ZeRO-1 "
                         "ShardedModel", Error);
    CHECK_THROWS_WITH_AS(model.to(DType::f16), doctest::Contains("to: parameter 'transformer.wte.weight' lives in the flat "
                                                                 "buffers of a ZeRO-1 ShardedModel"), Error);
    nn::Module* block = nullptr;
    for (const auto& [path, m] : model.named_modules())
      if (path == "transformer.h.0") block = m;
    REQUIRE(block != nullptr);
    CHECK_THROWS_WITH_AS(block->zero_grad(), doctest::Contains("zero_grad: this module has 12 of the 28 parameters"), Error);
  }
  // A weight registered a second time, in another module, is that same parameter:
  // listed once (it was a second leaf over the same storage, which packing refused).
  nn::GPT tied(zero_config(), kMeta);
  const auto make_tied = [&](int stage) { dist::ShardedModel(tied, group, {.stage = stage}); };
  const Tensor tied_wte = tied.named_parameters().front().second;
  const size_t count = tied.named_parameters().size();
  for (const auto& [path, m] : tied.named_modules())
    if (path == "transformer" || path == "transformer.h.0") m->register_parameter("tied", tied_wte);
  CHECK(tied.named_parameters().size() == count);
  // Shared by modules of two units (the root, block 0): at stage 3 block 0's forward
  // found the root's weights released; refused before anything moves.
  CHECK_THROWS_WITH_AS(make_tied(3),
                       "ShardedModel: parameter 'transformer.tied' is also registered as 'transformer.h.0.tied', "
                       "in another unit ('root' and 'transformer.h.0'); at stage 3 a unit's weights exist only around "
                       "its own forward, so modules that share a weight belong to one unit",
                       Error);
  CHECK_NOTHROW(make_tied(2));  // stages 0-2 keep every weight
}

TEST_CASE("a ShardedModel or DeviceMesh whose process group was destroyed first says so, with no undefined behaviour") {
  // Before, a forward read the freed group (a heap-use-after-free under ASan).
  const char* model_error = "ShardedModel: the process group or device mesh it was built on was destroyed; keep "
                            "them alive as long as the model";
  dist::run_local(2, [&](dist::ProcessGroup& pg) {
    const auto [x, y] = global_batch(0);
    for (int stage : {0, 3}) {
      INFO("stage " << stage);
      manual_seed(1);
      nn::GPT model(zero_config());
      std::unique_ptr<dist::ProcessGroup> group = pg.split(0, pg.rank());  // every rank: a group of the user's own
      dist::ShardedModel sharded(model, *group, ZeroRun{.stage = stage}.config());
      group.reset();
      // ZeRO-3's forward gathers; the others' backward reduces.
      CHECK_THROWS_WITH_AS(model.forward(x, y).loss.backward(), model_error, Error);
      CHECK_THROWS_WITH_AS(sharded.step(1e-3), model_error, Error);
    }
    std::unique_ptr<dist::ProcessGroup> group = pg.split(0, pg.rank());
    dist::DeviceMesh mesh(*group, {{"dp", 2}});
    group.reset();
    for (const auto& use : std::vector<std::function<void()>>{[&] { mesh.group("dp"); }, [&] { mesh.coordinate("dp"); },
                                                              [&] { mesh.describe(); }})
      CHECK_THROWS_WITH_AS(use(), "DeviceMesh: the process group it was built on was destroyed; keep the group alive "
                                  "as long as the mesh", Error);
  });
}

TEST_CASE("on a fake group with real tensors: DDP trains as one rank, and sharded stages are refused") {
  // Its collectives moved nothing, so at stage 2 the grad norm was inf and at stage 3 the loss NaN.
  Context rank0;
  ContextGuard guard(rank0);
  dist::FakeGroup one(0, 1), two(0, 2);
  const nn::NamedTensors alone = train_sharded(one, {.stage = 3, .steps = 2});
  for (const auto& [name, t] : alone) CHECK(std::isfinite(sum(t).item<double>()));
  CHECK(max_difference(train_sharded(one, {.stage = 0, .steps = 2}), alone) <= 1e-6);
  for (const auto& [name, t] : train_sharded(two, {.stage = 0, .steps = 2})) CHECK(std::isfinite(sum(t).item<double>()));
  for (int stage = 1; stage <= 3; ++stage)
    CHECK_THROWS_WITH_AS(train_sharded(two, {.stage = stage, .steps = 1}),
                         doctest::Contains("fake group: rank 0 of 2 cannot compute"), Error);
}

}  // namespace zg::test
