// ZeRO with parameters out of the ordinary: used on some ranks only, or by none in a
// backward; frozen; empty; in AdamW parameter groups. Each trains like one rank.
#include "dist/comm/fake_group.h"
#include "dist/comm/local_group.h"
#include "dist/zero/sharded_model.h"
#include "nn/checkpoint.h"
#include "nn/serialize.h"
#include "zero_cases.h"
#include "zero_training.h"

#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <unistd.h>

namespace zg::test {

// TwoLayers' batch of step s: inputs [4, 3] and targets [4, 1], drawn apart from the ranks' generators.
std::pair<Tensor, Tensor> two_layers_batch(int s) {
  Context scratch;
  ContextGuard guard(scratch);
  manual_seed(500 + s);
  Tensor x = rand({4, 3}, DType::f64);
  return {x, rand({4, 1}, DType::f64)};
}

TEST_CASE("each backward ends with its reductions done and nothing gathered, whatever got no gradient") {
  // Before, the end of a backward was the moment every bucket had all its gradients:
  //  - with a parameter that gets none, that never came. Stage 2 kept the unit's full
  //    gradient after backward, and under gradient accumulation the next micro-batch's
  //    first gradient completed the count and started the bucket's reduction while the
  //    rest of it was still being written (stage 1 up to 5e-4 off);
  //  - ZeRO-3 released a unit after its backward only through its input's gradient: the
  //    first unit (its input needs none) stayed gathered, and the next forward used its
  //    weights from before the step.
  const auto train = [](int n, int stage) {
    nn::NamedTensors result;
    dist::run_local(n, [&](dist::ProcessGroup& pg) {
      manual_seed(1);
      TwoLayers model;
      dist::ShardedModel sharded(model, {.units = {"a", "b"}}, pg,
                                 {.stage = stage, .compute_dtype = DType::f64, .adamw = kAdamW});
      const int64_t gradient_bytes = memory_stats()[MemoryCategory::gradient];
      for (int s = 0; s < 3; ++s) {
        const auto [x, y] = two_layers_batch(s);
        sharded.zero_grad();
        const int64_t rows = 4 / n, micro = rows / 2;
        for (int k = 0; k < 2; ++k) {
          const int64_t begin = pg.rank() * rows + k * micro;
          (mean(pow(model(x.narrow(0, begin, micro)) - y.narrow(0, begin, micro), 2.0)) * 0.5).backward();
          INFO("N=" << n << " stage " << stage << " step " << s << " micro-batch " << k);
          if (stage >= 2) CHECK(memory_stats()[MemoryCategory::gradient] == gradient_bytes);
          CHECK(memory_stats()[MemoryCategory::communication] == 0);
        }
        sharded.step(1e-2);
      }
      keep_master(pg, sharded, 0, result);
    });
    return result;
  };
  const nn::NamedTensors reference = train(1, 0);
  for (int stage = 0; stage <= 3; ++stage) {
    INFO("stage " << stage);
    CHECK(max_difference(train(2, stage), reference) <= 1e-12);
  }
}

TEST_CASE("a parameter some ranks use and others do not trains like one rank, at any bucket size (stages 0-2)") {
  // The gate scales the hidden activations of one row of the global batch. Each rank
  // has rows 4/N of the batch in two micro-batches (sync on for the second only), so
  // with the gate on global row 1 it is used in a synced backward on one rank and not
  // on the others; on row 0, in an unsynced one. Before, buckets were reduced in the
  // order they filled: the ranks then issued their reductions in different orders (a
  // mismatch error at small buckets), and a bucket filled only while sync was off was
  // never reduced (each rank stepped with its own gradient).
  struct Gated : TwoLayers {
    Tensor gate = register_parameter("gate", full({4}, 0.5, DType::f64));
    Tensor rows;  // [B, 1]: 1 for the rows the gate scales
    Tensor forward(const Tensor& x) override {
      Tensor h = gelu((*a)(x));
      if (max(rows).item<double>() > 0) h = h + rows * (h * gate - h);
      return (*b)(h);
    }
  };
  const auto train = [](int n, int stage, int64_t bucket_bytes, int64_t gated_row) {
    nn::NamedTensors result;
    dist::run_local(n, [&](dist::ProcessGroup& pg) {
      manual_seed(1);
      Gated model;
      dist::ShardedModel sharded(model, {.units = {"a", "b"}}, pg,
                                 {.stage = stage, .compute_dtype = DType::f64, .adamw = kAdamW,
                                  .bucket_bytes = bucket_bytes});
      Tensor flags = zeros({4, 1}, DType::f64);
      flags.narrow(0, gated_row, 1).fill_(1.0);
      for (int s = 0; s < 3; ++s) {
        const auto [x, y] = two_layers_batch(s);
        sharded.zero_grad();
        const int64_t rows = 4 / n, micro = std::max<int64_t>(1, rows / 2), steps = rows / micro;
        for (int64_t k = 0; k < steps; ++k) {
          const int64_t begin = pg.rank() * rows + k * micro;
          sharded.set_gradient_sync(k == steps - 1);
          model.rows = flags.narrow(0, begin, micro);
          (mean(pow(model(x.narrow(0, begin, micro)) - y.narrow(0, begin, micro), 2.0)) * (1.0 / steps)).backward();
        }
        sharded.step(1e-2);
      }
      keep_master(pg, sharded, n - 1, result);
    });
    return result;
  };
  for (int64_t gated_row : {0, 1}) {
    const nn::NamedTensors reference = train(1, 0, 25 << 20, gated_row);
    for (int n : {2, 4})
      for (int stage = 0; stage <= 2; ++stage)
        for (int64_t bucket_bytes : {int64_t{8}, int64_t{25 << 20}}) {
          INFO("gate on row " << gated_row << " N=" << n << " stage " << stage << " buckets of " << bucket_bytes);
          CHECK(max_difference(train(n, stage, bucket_bytes, gated_row), reference) <= 1e-12);
        }
  }
}

TEST_CASE("ZeRO-3: a parameter some ranks use, inside a unit between others, trains like one rank") {
  // x -> a: Linear(3, 4) -> gelu -> g (h + rows * (h * gate - h)) -> b: Linear(4, 1), each
  // a unit: the gate gets a gradient on the rank whose rows it scales, and on the others
  // none. Before, a unit was reduced once all its gradients had come: there right after
  // g's backward, elsewhere at the backward's end -- after a's gather, so the ranks' collectives
  // differed (a mismatch error). Now each unit is reduced when its backward is done, the
  // same moment on every rank, with zeros for what never came. (With g checkpointed, its
  // recompute's input is a leaf, whose AccumulateGrad runs before the gate's -- `gate * h`
  // made the gate's first: the moment is taken at an alias of the input instead.)
  struct Gate : nn::Module {
    Tensor gate = register_parameter("gate", full({4}, 0.5, DType::f64));
    Tensor rows;  // [B, 1]: 1 for the rows the gate scales
    Tensor forward(const Tensor& h) override { return max(rows).item<double>() > 0 ? h + rows * (gate * h - h) : h * 1.0; }
  };
  struct Gated : nn::Module {
    std::shared_ptr<nn::Linear> a = register_module("a", std::make_shared<nn::Linear>(3, 4, true, 0.5, TensorOptions(DType::f64)));
    std::shared_ptr<Gate> g = register_module("g", std::make_shared<Gate>());
    std::shared_ptr<nn::Linear> b = register_module("b", std::make_shared<nn::Linear>(4, 1, true, 0.5, TensorOptions(DType::f64)));
    bool checkpointing = false;  // g's forward recomputed in the backward
    int applications = 1;        // g applied this many times (its unit reduced after the last backward)
    Tensor forward(const Tensor& x) override {
      Tensor h = gelu((*a)(x));
      for (int k = 0; k < applications; ++k)
        h = checkpointing ? nn::checkpoint([&](const std::vector<Tensor>& in) { return (*g)(in[0]); }, {h}) : (*g)(h);
      return (*b)(h);
    }
  };
  const auto train = [](int n, int stage, int prefetch, bool checkpointing, int applications) {
    nn::NamedTensors result;
    dist::run_local(n, [&](dist::ProcessGroup& pg) {
      manual_seed(1);
      Gated model;
      model.checkpointing = checkpointing;
      model.applications = applications;
      dist::ShardedModel sharded(model, {.units = {"a", "g", "b"}}, pg,
                                 {.stage = stage, .compute_dtype = DType::f64, .adamw = kAdamW, .prefetch = prefetch});
      Tensor flags = zeros({4, 1}, DType::f64);
      flags.narrow(0, 1, 1).fill_(1.0);
      for (int s = 0; s < 3; ++s) {
        const auto [x, y] = two_layers_batch(s);
        const int64_t rows = 4 / n, begin = pg.rank() * rows;
        sharded.zero_grad();
        model.g->rows = flags.narrow(0, begin, rows);
        mean(pow(model(x.narrow(0, begin, rows)) - y.narrow(0, begin, rows), 2.0)).backward();
        sharded.step(1e-2);
      }
      keep_master(pg, sharded, n - 1, result);
    });
    return result;
  };
  for (int applications : {1, 2}) {
    const nn::NamedTensors reference = train(1, 0, 1, false, applications);
    for (int n : {2, 4})
      for (int prefetch : {0, 1})
        for (bool checkpointing : {false, true}) {
          INFO("g applied " << applications << " times, N=" << n << " prefetch " << prefetch << " checkpointing "
                            << checkpointing);
          CHECK(max_difference(train(n, 3, prefetch, checkpointing, applications), reference) <= 1e-12);
        }
  }
}

TEST_CASE("frozen parameters: untrained, in checkpoints, whole on every rank at stages 0-2 and sharded at 3") {
  // N ranks against one: gradients summed in another order, then AdamW in f32 (as on a
  // GPU), whose m / sqrt(v) turns a last-bit difference of a tiny gradient into ~1e-5
  // (2.7e-5 at N = 2 since the CPU GELU's 1 + tanh u became 2 / (1 + exp(-2u)); a wrong
  // shard or a missing gradient moves a weight by about the learning rate, 1e-2).
  constexpr double kRounding = 4e-5;
  // Before, a frozen parameter was refused. Now it has no gradient, master or Adam state,
  // and is held in the compute dtype: whole on every rank at stages 0-2 (a unit with
  // nothing left to train drops out), sharded with its unit at stage 3. Here the tied
  // embedding and head (in the root unit) and all of block 0.
  const std::string dir = "/tmp/zg_test_sharded_frozen_" + std::to_string(::getpid());
  const auto frozen = [](const std::string& name) {
    return name == "transformer.wte.weight" || name.starts_with("transformer.h.0.");
  };
  struct Result {
    nn::NamedTensors master, frozen;
    int64_t parameter_bytes = 0;  // rank 0's, after construction
  };
  const auto run = [&](int n, int stage, int seed, const std::function<void(dist::ProcessGroup&, nn::GPT&, dist::ShardedModel&)>& fn,
                       bool checkpointing = false, bool freeze = true) {
    Result result;
    dist::run_local(n, [&](dist::ProcessGroup& pg) {
      manual_seed(seed);
      nn::GPT model(zero_config(checkpointing), TensorOptions(DType::f64));
      for (auto& [name, p] : model.named_parameters())
        if (freeze && frozen(name)) p.set_requires_grad(false);
      dist::ShardedModel sharded(model, pg,
                                 {.stage = stage, .compute_dtype = DType::f32, .adamw = kAdamW});
      if (pg.rank() == 0) result.parameter_bytes = memory_stats()[MemoryCategory::parameter];
      fn(pg, model, sharded);
      const nn::NamedTensors master = sharded.gathered_master();
      const nn::NamedTensors state = sharded.consolidated_state();  // at stage 3 the frozen weights are sharded too
      const nn::NamedTensors listed = model.named_parameters();  // ... in the model's order (a GPT has no buffers)
      REQUIRE(state.size() == listed.size());
      for (size_t i = 0; i < state.size(); ++i) CHECK(state[i].first == listed[i].first);
      if (pg.rank() != n - 1) return;
      for (auto& [name, t] : master) result.master.emplace_back(name, t.clone());
      for (auto& [name, t] : state)
        if (frozen(name)) result.frozen.emplace_back(name, t);
    });
    return result;
  };
  // Bytes of f32 compute weights per rank: at stage 3 each unit's trained and frozen
  // parameters are two buffers, each padded to a multiple of N and sharded; at stages
  // 0-2 every rank holds all of them (block 0 has no unit left, so no padding).
  std::map<std::pair<std::string, bool>, int64_t> numel;  // (unit, frozen) -> elements
  for (const auto& [name, p] : nn::GPT(zero_config(), kMeta).named_parameters()) {
    const std::string unit = name.starts_with("transformer.h.") ? name.substr(0, name.find('.', 14)) : "root";
    numel[{unit, frozen(name)}] += p.numel();
  }
  const auto parameter_bytes = [&](int n, int stage) {
    int64_t bytes = 0;
    for (const auto& [key, count] : numel) {
      const bool padded = stage == 3 || !key.second;
      bytes += 4 * (padded ? (count + n - 1) / n * n : count) / (stage == 3 ? n : 1);
    }
    return bytes;
  };
  const auto train = [](dist::ProcessGroup& pg, nn::GPT& model, dist::ShardedModel& sharded) {
    for (int s = 0; s < 3; ++s) {
      const auto [x, y] = global_batch(s);
      const int64_t rows = kBatch / pg.size();
      sharded.zero_grad();
      model.forward(x.narrow(0, pg.rank() * rows, rows), y.narrow(0, pg.rank() * rows, rows)).loss.backward();
      sharded.step(1e-2);
    }
  };
  nn::NamedTensors initial;  // the frozen weights as built, rounded to the compute dtype
  const Result reference = run(1, 0, 1, [&](dist::ProcessGroup& pg, nn::GPT& model, dist::ShardedModel& sharded) {
    for (auto& [name, p] : model.named_parameters())
      if (frozen(name)) initial.emplace_back(name, p.clone());
    train(pg, model, sharded);
  });
  REQUIRE(initial.size() == 13);  // wte and block 0's 12
  CHECK(initial.front().second.dtype() == DType::f32);
  CHECK(reference.master.size() == nn::GPT(zero_config(), kMeta).named_parameters().size() - 13);
  CHECK(max_difference(reference.frozen, initial) == 0);  // untrained
  for (int n : {2, 4})
    for (int stage = 0; stage <= 3; ++stage) {
      INFO("N=" << n << " stage " << stage);
      const Result sharded = run(n, stage, 1, [&](dist::ProcessGroup& pg, nn::GPT& model, dist::ShardedModel& s) {
        train(pg, model, s);
        if (n != 4 || stage != 3) return;
        // Each rank writes the frozen weights it holds, its slice of each unit's frozen
        // buffer: nothing is gathered (rank 0 used to gather and write them all).
        Context::current().allocator(kCPU)->reset_peaks();
        s.save(dir);
        MemoryStats after = memory_stats();
        CHECK(after.peak_of(MemoryCategory::other) < 1024);  // a few one-number agreements; not 59008 bytes of weights
        CHECK(after.peak_of(MemoryCategory::communication) - after[MemoryCategory::communication] < 1024);
        int64_t held = 0, written = 0;  // this rank's frozen elements, without the padding
        for (const auto& [key, count] : numel) {
          const int64_t slice = (count + 3) / 4;
          if (key.second) held += std::clamp<int64_t>(count - pg.rank() * slice, 0, slice);
        }
        const SafetensorsFile mine(dist::ShardedModel::current_save(dir) + "/rank-0000" + std::to_string(pg.rank()) +
                                   "-of-00004.safetensors");
        for (const std::string& name : mine.names())
          if (name.starts_with("frozen/")) written += zg::numel(mine.entry(name).shape);
        CHECK(written == held);
        // The export, likewise: one unit's weights, trained (master) or frozen, gathered at
        // a time -- not the whole model on every rank.
        int64_t largest = 0;  // f32 elements
        for (const auto& [key, count] : numel) largest = std::max(largest, (count + 3) / 4 * 4);
        Context::current().allocator(kCPU)->reset_peaks();
        s.export_consolidated(dir + "/consolidated.safetensors");
        after = memory_stats();
        CHECK(after.peak_of(MemoryCategory::other) < 1024);
        CHECK(after.peak_of(MemoryCategory::communication) - after[MemoryCategory::communication] == largest * 4);
        const nn::NamedTensors state = s.consolidated_state();  // the same tensors, in the same order
        if (pg.rank() != 0) return;
        const SafetensorsFile exported(dir + "/consolidated.safetensors");
        REQUIRE(exported.names().size() == state.size());
        for (size_t i = 0; i < state.size(); ++i) {
          CHECK(exported.names()[i] == state[i].first);
          CHECK(max_difference({{state[i].first, exported.read(state[i].first)}}, {state[i]}) == 0);
        }
      });
      CHECK(max_difference(sharded.master, reference.master) <= kRounding);
      CHECK(max_difference(sharded.frozen, initial) == 0);
      CHECK(sharded.parameter_bytes == parameter_bytes(n, stage));
    }
  // With activation checkpointing, the all-frozen block 0 is gathered again for its recompute.
  const Result recomputed = run(2, 3, 1, train, /*checkpointing=*/true);
  CHECK(max_difference(recomputed.master, reference.master) <= kRounding);
  CHECK(max_difference(recomputed.frozen, initial) == 0);
  // Saved at N = 4 stage 3, loaded into a model of other initial weights: at N = 2 stage 1
  // (frozen weights whole), and at N = 1 and N = 2 stage 3 (each rank keeps its slice),
  // where training goes on from there.
  const Result loaded = run(2, 1, 7, [&](dist::ProcessGroup&, nn::GPT&, dist::ShardedModel& s) { s.load(dir); });
  CHECK(max_difference(loaded.frozen, initial) == 0);
  CHECK(max_difference(loaded.master, reference.master) <= kRounding);
  const Result continued = run(2, 3, 1, [&](dist::ProcessGroup& pg, nn::GPT& model, dist::ShardedModel& s) {
    train(pg, model, s);
    train(pg, model, s);
  });
  for (int n : {1, 2}) {
    INFO("loaded at N=" << n << " stage 3");
    const Result resumed = run(n, 3, 7, [&](dist::ProcessGroup& pg, nn::GPT& model, dist::ShardedModel& s) {
      s.load(dir);
      train(pg, model, s);
    });
    CHECK(max_difference(resumed.frozen, initial) == 0);
    // (Six f32 steps at N = 1 and N = 2, uninterrupted, differ by 2.3e-5 from rounding
    // alone; wrong frozen slices would differ by far more.)
    CHECK(max_difference(resumed.master, continued.master) <= 1e-4);
  }
  // A save of format 3, whose first file held the frozen weights whole (gathered for rank
  // 0), still loads: the same save, rewritten so.
  std::map<std::string, Tensor> whole;  // frozen/<name> -> its weights, from the pieces
  for (const auto& [name, t] : initial) whole["frozen/" + name] = zeros(t.shape(), TensorOptions(t.dtype()));
  const auto file_of = [&](int q) {
    return dist::ShardedModel::current_save(dir) + "/rank-0000" + std::to_string(q) + "-of-00004.safetensors";
  };
  for (int q = 0; q < 4; ++q) {
    const SafetensorsFile file(file_of(q));
    for (const std::string& name : file.names())
      if (name.starts_with("frozen/")) {
        const size_t last = name.rfind('/');
        const Tensor piece = file.read(name);
        whole.at(name.substr(0, last)).view({-1}).narrow(0, std::stoll(name.substr(last + 1)), piece.numel()).copy_(piece);
      }
  }
  for (int q = 0; q < 4; ++q) {
    const SafetensorsFile file(file_of(q));
    std::vector<std::pair<std::string, Tensor>> content;
    for (const std::string& name : file.names())
      if (!name.starts_with("frozen/")) content.emplace_back(name, file.read(name));
    if (q == 0) content.insert(content.end(), whole.begin(), whole.end());
    Metadata meta = file.metadata();
    meta["format"] = "zerograd-sharded-checkpoint-3";
    save_safetensors(file_of(q), content, meta);
  }
  for (int stage : {1, 3}) {
    INFO("format 3, loaded at N=2 stage " << stage);
    const Result old = run(2, stage, 7, [&](dist::ProcessGroup&, nn::GPT&, dist::ShardedModel& s) { s.load(dir); });
    CHECK(max_difference(old.frozen, initial) == 0);
    CHECK(max_difference(old.master, reference.master) <= kRounding);
  }
  // A save that trained every parameter loads into a model that freezes some (fine-tuning
  // a pre-trained model): their master weights become the frozen weights.
  const Result pretrained = run(
      2, 2, 3,
      [&](dist::ProcessGroup& pg, nn::GPT& model, dist::ShardedModel& s) {
        train(pg, model, s);
        s.save(dir);
      },
      /*checkpointing=*/false, /*freeze=*/false);
  nn::NamedTensors pretrained_frozen, pretrained_trained;
  for (const auto& [name, t] : pretrained.master) (frozen(name) ? pretrained_frozen : pretrained_trained).emplace_back(name, t);
  for (int stage : {0, 3}) {
    INFO("a trained save, loaded with some parameters frozen at N=4 stage " << stage);
    const Result tuned = run(4, stage, 7, [&](dist::ProcessGroup&, nn::GPT&, dist::ShardedModel& s) { s.load(dir); });
    CHECK(max_difference(tuned.frozen, pretrained_frozen) == 0);
    CHECK(max_difference(tuned.master, pretrained_trained) == 0);
  }
  // Unfrozen after the ShardedModel was built: its gradient would go nowhere.
  CHECK_THROWS_WITH_AS(run(2, 2, 1,
                           [&](dist::ProcessGroup&, nn::GPT& model, dist::ShardedModel& s) {
                             model.named_parameters().front().second.set_requires_grad(true);
                             s.step(1e-2);
                           }),
                       doctest::Contains("parameter 'transformer.wte.weight' was frozen when the ShardedModel was built "
                                         "and requires grad now"),
                       Error);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a unit of empty parameters steps like any other; save refuses metadata keys it writes itself") {
  dist::run_local(2, [](dist::ProcessGroup& pg) {
    struct WithEmpty : nn::Module {
      std::shared_ptr<nn::Linear> a = register_module("a", std::make_shared<nn::Linear>(2, 2));
      std::shared_ptr<nn::Module> e = register_module("e", std::make_shared<nn::Module>());
      WithEmpty() { e->register_parameter("w", zeros({0, 4})); }
    } model;
    for (int stage = 0; stage <= 3; ++stage) {
      // Every step() failed: the norm took sum_of_squares of the empty gradient shard.
      dist::ShardedModel sharded(model, {.units = {"e", "a"}}, pg, {.stage = stage, .compute_dtype = DType::f32});
      sum((*model.a)(ones({1, 2}))).backward();
      CHECK(sharded.step(1e-3).stepped);
      if (stage < 3) continue;
      // A caller's "step" was replaced by the checkpoint's, silently.
      CHECK_THROWS_WITH_AS(sharded.save("/tmp/zg_test_reserved_keys", {{"loss_scale", "3"}}),
                           doctest::Contains("the metadata key 'loss_scale' is one the checkpoint writes itself"),
                           Error);  // without a scaler it was written, and loaded as one
      CHECK_THROWS_WITH_AS(sharded.save("/tmp/zg_test_reserved_keys", {{"step", "7"}}),
                           "ShardedModel::save: the metadata key 'step' is one the checkpoint writes itself; name it "
                           "otherwise (nothing was saved, on any rank)",
                           Error);
      CHECK_THROWS_WITH_AS(sharded.save("/tmp/zg_test_reserved_keys", {{"shape/a.weight", "[9]"}}),
                           doctest::Contains("the metadata key 'shape/a.weight'"), Error);
      CHECK_FALSE(std::filesystem::exists("/tmp/zg_test_reserved_keys"));  // refused before anything is written
    }
  });
  CHECK(sum_of_squares(zeros({0})).item<float>() == 0);  // an empty sum
}

TEST_CASE("DDP: ranks that use different parameters average each one's gradients, zeros where unused") {
  // Two one-element buckets, each filled on the rank that used its parameter only. Once
  // these all-reduces paired rank 0's p with rank 1's q (p.grad 1.5); then they were a
  // mismatch error; now both ranks reduce p, then q (the fixed order).
  dist::run_local(2, [](dist::ProcessGroup& pg) {
    struct Pair : nn::Module {
      Tensor p = register_parameter("p", ones({1}));
      Tensor q = register_parameter("q", ones({1}));
    } model;
    dist::ShardedModel sharded(model, {}, pg, {.stage = 0, .compute_dtype = DType::f32, .bucket_bytes = 4});
    sum(pg.rank() == 0 ? model.p : model.q * 2.0).backward();
    CHECK(model.p.grad().item<float>() == 0.5f);  // (1 + 0) / 2
    CHECK(model.q.grad().item<float>() == 1.0f);  // (0 + 2) / 2
  });
}

TEST_CASE("parameter groups: each group's lr scale and weight decay, at every stage and N = 1, 2") {
  // One step of the tiny GPT with groups, each parameter compared with an ungrouped step at
  // the lr and decay its group gives (one step: the gradients are the same in every run).
  const auto train = [](dist::ProcessGroup& pg, int stage, double lr, optim::AdamWOptions adamw) {
    manual_seed(1);
    nn::GPT model(zero_config());
    dist::ShardedModel sharded(model, pg, {.stage = stage, .compute_dtype = DType::f32, .adamw = adamw});
    const int64_t rows = kBatch / pg.size();
    const auto [x, y] = global_batch(0);
    model.forward(x.narrow(0, pg.rank() * rows, rows), y.narrow(0, pg.rank() * rows, rows)).loss.backward();
    sharded.step(lr);
    nn::NamedTensors out;
    for (const auto& [name, t] : sharded.gathered_master()) out.emplace_back(name, t.clone());
    return out;
  };
  const auto one_rank = [&](double lr, optim::AdamWOptions adamw) {
    Context rank;
    ContextGuard guard(rank);
    dist::SingleRank one;
    return train(one, 0, lr, adamw);
  };
  optim::AdamWOptions grouped = kAdamW;
  grouped.groups = {{.names = {"*.bias", "*.ln_?.*"}, .lr_scale = 0.5},
                    {.names = {"transformer.wte.weight"}, .lr_scale = 1.0, .weight_decay = 0.0}};
  // The tied embedding by its other name: a group matches any name of a parameter.
  optim::AdamWOptions by_head = grouped;
  by_head.groups[1].names = {"lm_head.weight"};
  optim::AdamWOptions no_decay = kAdamW;
  no_decay.weight_decay = 0;
  const nn::NamedTensors plain = one_rank(1e-3, kAdamW), half = one_rank(5e-4, kAdamW), undecayed = one_rank(1e-3, no_decay);
  const auto value = [](const nn::NamedTensors& ts, const std::string& name) {
    for (const auto& [n, t] : ts)
      if (n == name) return t;
    FAIL("no parameter " << name);
    return Tensor();
  };
  const auto expected = [&](const std::string& name) {
    if (name == "transformer.wte.weight") return value(undecayed, name);
    const bool in_first = name.ends_with(".bias") || name.find(".ln_") != std::string::npos;  // ln_1, ln_2, ln_f
    return value(in_first ? half : plain, name);
  };
  for (int n : {1, 2})
    for (int stage : {0, 3}) {
      nn::NamedTensors got;
      dist::run_local(n, [&](dist::ProcessGroup& pg) {
        nn::NamedTensors mine = train(pg, stage, 1e-3, n == 1 ? by_head : grouped);
        if (pg.rank() == 0) got = std::move(mine);
      });
      for (const auto& [name, t] : got) {
        const std::string& parameter = name;  // (Clang's INFO cannot capture a structured binding)
        INFO("N=" << n << " stage " << stage << " " << parameter);
        CHECK(max(abs(t - expected(name))).item<double>() < 1e-6);
      }
    }
  CHECK(max(abs(value(plain, "transformer.h.0.ln_1.bias") - value(half, "transformer.h.0.ln_1.bias"))).item<double>() > 1e-5);
  optim::AdamWOptions bad = kAdamW;
  bad.groups = {{.names = {"*.bias"}, .lr_scale = -1}};
  CHECK_THROWS_WITH_AS(one_rank(1e-3, bad), "AdamW: parameter group 0: lr_scale must be >= 0 and finite, got -1", Error);
  // A group whose patterns match nothing did nothing, silently (a typo, or a name the model does not use).
  optim::AdamWOptions typo = kAdamW;
  typo.groups = {{.names = {"*.bias"}, .lr_scale = 0.5}, {.names = {"*.lm_head", "ln_f.*"}, .weight_decay = 0.0}};
  CHECK_THROWS_WITH_AS(one_rank(1e-3, typo),
                       "ShardedModel: AdamW parameter group 1 ('*.lm_head', 'ln_f.*') matches no trained parameter's "
                       "name (names look like 'transformer.wte.weight'; patterns are globs)",
                       Error);
}

}  // namespace zg::test
