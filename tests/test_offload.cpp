// ZeRO-Offload: the optimizer state (and at stage 3 the parameter shards) in the rank's
// host pool changes where bytes live, never what is computed: offloaded runs equal the
// same run on the device bit for bit, their figures split device and host as the
// placement says, and their checkpoints load with or without offload.
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>

#include "helpers.h"

#include "dist/comm/fake_group.h"
#include "dist/comm/local_group.h"
#include "zero_training.h"

namespace zg::test {

namespace {

struct OffloadRun {
  int stage = 1;
  dist::Offload offload = dist::Offload::none;
  DType dtype = DType::bf16;
  int steps = 4;
  int micro_batches = 2;
};

struct Trained {
  nn::NamedTensors master;    // gathered, on the cpu
  std::vector<double> norms;  // every step's global gradient norm (NaN: skipped)
  std::vector<double> scales; // the loss scale after every step
};

dist::ZeroConfig config_of(const OffloadRun& run) {
  return {.stage = run.stage, .compute_dtype = run.dtype, .adamw = kAdamW, .max_grad_norm = 0.05,
          .offload = run.offload, .offload_dir = std::filesystem::temp_directory_path().string()};
}

// Trains the tiny GPT on this rank's slice of each global batch with a loss scaler and
// clipping, step 1 overflowing on purpose (every rank skips it).
Trained train(dist::ProcessGroup& pg, const OffloadRun& run) {
  manual_seed(1);
  nn::GPT model(zero_config());
  dist::ShardedModel sharded(model, pg, config_of(run));
  optim::GradScaler scaler({.init_scale = 1024.0});
  const int64_t rows = kBatch / pg.size();
  const int micro = rows >= run.micro_batches ? run.micro_batches : 1;
  Trained out;
  for (int s = 0; s < run.steps; ++s) {
    const auto [x, y] = global_batch(s);
    sharded.zero_grad();
    for (int k = 0; k < micro; ++k) {
      const int64_t r = rows / micro, from = pg.rank() * rows + k * r;
      Tensor loss = scaler.scale(model.forward(x.narrow(0, from, r), y.narrow(0, from, r)).loss * (1.0 / micro));
      if (s == 1 && pg.rank() == 0) loss = loss * std::numeric_limits<double>::infinity();
      loss.backward();
    }
    const dist::StepResult result = sharded.step(1e-3, &scaler);
    out.norms.push_back(result.stepped ? result.grad_norm : std::nan(""));
    out.scales.push_back(scaler.scale_factor());
  }
  for (auto& [name, t] : sharded.gathered_master()) out.master.emplace_back(name, t.to(kCPU).clone());
  return out;
}

Trained train_on(int n, const OffloadRun& run) {
  Trained kept;
  dist::run_local(n, [&](dist::ProcessGroup& pg) {
    Trained mine = train(pg, run);
    if (pg.rank() == n - 1) kept = std::move(mine);
  });
  return kept;
}

// Every element equal (the bits of f32 values; NaN never occurs in master weights).
bool same_bits(const nn::NamedTensors& a, const nn::NamedTensors& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].first != b[i].first || max(abs(a[i].second - b[i].second)).item<double>() != 0.0) return false;
  return true;
}

bool same_norms(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) return false;
  return true;
}

int64_t model_states(const MemoryStats& s) {
  return s[MemoryCategory::parameter] + s[MemoryCategory::gradient] + s[MemoryCategory::optimizer_state];
}

}  // namespace

TEST_CASE("offload on or off (host pool, file tier): the same bits at N = 1, 2, 4 and stages 1-3, with clipping, a "
          "loss scaler, a skipped step and two micro-batches") {
  for (DType dtype : {DType::bf16, DType::f32})
    for (int n : {1, 2, 4})
      for (int stage = 1; stage <= 3; ++stage) {
        const Trained device = train_on(n, {.stage = stage, .dtype = dtype});
        CHECK(std::isnan(device.norms[1]));  // the overflow was skipped
        for (dist::Offload offload : {dist::Offload::optimizer, dist::Offload::optimizer_and_params, dist::Offload::nvme}) {
          if (offload == dist::Offload::optimizer_and_params && stage != 3) continue;
          INFO(name(dtype) << " N=" << n << " stage " << stage << " offload " << dist::name(offload));
          const Trained host = train_on(n, {.stage = stage, .offload = offload, .dtype = dtype});
          CHECK(same_bits(host.master, device.master));
          CHECK(same_norms(host.norms, device.norms));
          CHECK(host.scales == device.scales);
        }
      }
}

TEST_CASE("offloaded roles are counted in the host pool, the rest on the device (bf16, N = 2)") {
  for (int stage = 1; stage <= 3; ++stage)
    for (dist::Offload offload : {dist::Offload::optimizer, dist::Offload::optimizer_and_params}) {
      if (offload == dist::Offload::optimizer_and_params && stage != 3) continue;
      INFO("stage " << stage << " offload " << dist::name(offload));
      dist::run_local(2, [&](dist::ProcessGroup& pg) {
        manual_seed(1);
        nn::GPT model(zero_config());
        dist::ShardedModel sharded(model, pg, config_of({.stage = stage, .offload = offload}));
        int64_t padded = 0;  // each unit's count padded to a multiple of N = 2
        for (const std::string unit : {"root", "transformer.h.0", "transformer.h.1"}) {
          int64_t count = 0;
          for (const auto& [name, p] : model.named_parameters()) {
            const bool in_block = name.starts_with("transformer.h.");
            if ((unit == "root" && !in_block) || (in_block && name.starts_with(unit + "."))) count += p.numel();
          }
          padded += (count + 1) / 2 * 2;
        }
        const int64_t shard = padded / 2;
        const auto [x, y] = global_batch(0);
        sharded.zero_grad();
        model.forward(x.narrow(0, 2 * pg.rank(), 2), y.narrow(0, 2 * pg.rank(), 2)).loss.backward();
        const MemoryStats device = memory_stats(), host = host_memory_stats();
        // Host: f32 master, m, v (12 bytes) and the bf16 gradient shard (2), per element of the shard.
        CHECK(host[MemoryCategory::optimizer_state] == 12 * shard);
        CHECK(host[MemoryCategory::gradient] == 2 * shard);
        CHECK(host[MemoryCategory::parameter] == 0);  // at optimizer+params the master is the shard
        CHECK(device[MemoryCategory::optimizer_state] == 0);
        // Device: the compute weights (whole at stages 1-2, the shard at 3 unless offloaded)
        // and, at stage 1, the full gradient.
        const int64_t weights = stage < 3 ? 2 * padded : offload == dist::Offload::optimizer ? 2 * shard : 0;
        CHECK(device[MemoryCategory::parameter] == weights);
        CHECK(device[MemoryCategory::gradient] == (stage == 1 ? 2 * padded : 0));
        sharded.step(1e-3);
        CHECK(host_memory_stats()[MemoryCategory::communication] == 0);  // no staging left behind
      });
    }
}

TEST_CASE("GPT 7.5B, one rank, ZeRO-3 offloading optimizer and parameters: 14Ψ on the host, units in use on the device") {
  Context rank0;
  ContextGuard guard(rank0);
  dist::FakeGroup group(0, 1);
  nn::GPTConfig c;
  c.n_layer = 36, c.n_head = 32, c.n_embd = 4096, c.vocab_size = 60000, c.block_size = 1024;
  nn::GPT model(c, kMeta);
  dist::ShardedModel sharded(model, group,
                             {.stage = 3, .compute_dtype = DType::bf16, .offload = dist::Offload::optimizer_and_params});
  Context::current().allocator(kMeta)->reset_peaks();  // the model as built, before sharding, is gone
  const double psi = static_cast<double>(sharded.num_parameters());
  const Tensor ids = zeros({1, 128}, TensorOptions(DType::i64).device(kMeta));
  sharded.zero_grad();
  model.forward(ids, ids).loss.backward();
  const MemoryStats host = host_memory_stats(kMeta);
  CHECK(std::abs(static_cast<double>(model_states(host)) / (14 * psi) - 1) < 0.005);
  CHECK(model_states(memory_stats(kMeta)) == 0);  // after backward: nothing persistent on the device
  sharded.step(1e-4);
  // During the step: no parameter or optimizer state on the device ever; gradients of at
  // most two units at once -- the root's (the tied embedding gets its gradient first from
  // the head, last from the lookup, so it lives through the backward) and one block's.
  const MemoryStats device = memory_stats(kMeta);
  const double root = 60000.0 * 4096 + 1024.0 * 4096 + 2 * 4096, block = 12.0 * 4096 * 4096 + 13 * 4096;
  CHECK(device.peak_of(MemoryCategory::parameter) == 0);
  CHECK(device.peak_of(MemoryCategory::optimizer_state) == 0);
  CHECK(device.peak_of(MemoryCategory::gradient) <= 2 * (root + block));
}

TEST_CASE("a checkpoint saved with offload resumes without it, and the reverse, at another N and stage") {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "zg_test_offload_checkpoint";
  std::filesystem::remove_all(dir);
  struct Leg {
    int n, stage;
    dist::Offload offload;
  };
  auto one_step = [](dist::ProcessGroup& pg, nn::GPT& model, dist::ShardedModel& sharded, int s) {
    const auto [x, y] = global_batch(s);
    const int64_t rows = kBatch / pg.size();
    sharded.zero_grad();
    model.forward(x.narrow(0, pg.rank() * rows, rows), y.narrow(0, pg.rank() * rows, rows)).loss.backward();
    sharded.step(1e-3);
  };
  auto keep = [](dist::ProcessGroup& pg, dist::ShardedModel& sharded, nn::NamedTensors& out) {
    const nn::NamedTensors all = sharded.gathered_master();
    if (pg.rank() == 0)
      for (const auto& [name, t] : all) out.emplace_back(name, t.to(kCPU).clone());
  };
  // Saved at `from`, loaded at `to` and at `to` with offload the other way: the loaded
  // weights are the saved ones, and the next step is the same bits either way.
  for (const auto& legs : {std::pair{Leg{2, 3, dist::Offload::optimizer_and_params}, Leg{1, 1, dist::Offload::none}},
                           std::pair{Leg{4, 2, dist::Offload::none}, Leg{2, 3, dist::Offload::optimizer_and_params}},
                           std::pair{Leg{1, 1, dist::Offload::optimizer}, Leg{4, 2, dist::Offload::optimizer}}}) {
    const Leg from = legs.first, to = legs.second;  // not a structured binding: lambdas capture these
    INFO("from N=" << from.n << " stage " << from.stage << " " << dist::name(from.offload) << " to N=" << to.n
                   << " stage " << to.stage << " " << dist::name(to.offload));
    nn::NamedTensors saved;
    dist::run_local(from.n, [&](dist::ProcessGroup& pg) {
      manual_seed(1);
      nn::GPT model(zero_config());
      dist::ShardedModel sharded(model, pg, config_of({.stage = from.stage, .offload = from.offload}));
      for (int s = 0; s < 2; ++s) one_step(pg, model, sharded, s);
      sharded.save(dir.string());
      keep(pg, sharded, saved);
    });
    nn::NamedTensors loaded[2], continued[2];
    const dist::Offload flipped = to.offload != dist::Offload::none ? dist::Offload::none
                                  : to.stage == 3                 ? dist::Offload::optimizer_and_params
                                                                  : dist::Offload::optimizer;
    for (int k = 0; k < 2; ++k)
      dist::run_local(to.n, [&](dist::ProcessGroup& pg) {
        manual_seed(2);  // other initial weights: the load replaces them
        nn::GPT model(zero_config());
        dist::ShardedModel sharded(model, pg, config_of({.stage = to.stage, .offload = k == 0 ? to.offload : flipped}));
        sharded.load(dir.string());
        keep(pg, sharded, loaded[k]);
        one_step(pg, model, sharded, 2);
        keep(pg, sharded, continued[k]);
      });
    CHECK(same_bits(loaded[0], saved));
    CHECK(same_bits(loaded[1], saved));
    CHECK(same_bits(continued[0], continued[1]));
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("with offload: frozen parameters, step_on_device, summon_full_params and the consolidated export as without") {
  // Stage 3 at N = 2, bf16: a frozen block (sharded, on the host with the parameters),
  // two steps without reading the norm back, then every parameter read whole and the
  // model exported; offload on and off give the same values.
  struct Result {
    nn::NamedTensors summoned, exported;
  };
  const std::filesystem::path folder = std::filesystem::temp_directory_path() / "zg_test_offload_export";
  std::filesystem::create_directories(folder);
  auto run = [&](dist::Offload offload) {
    Result result;
    const std::string file = (folder / (std::string(dist::name(offload)) + ".safetensors")).string();
    dist::run_local(2, [&](dist::ProcessGroup& pg) {
      manual_seed(1);
      nn::GPT model(zero_config());
      for (auto& [name, p] : model.named_parameters())
        if (name.starts_with("transformer.h.0.")) p.set_requires_grad(false);
      dist::ShardedModel sharded(model, pg, config_of({.stage = 3, .offload = offload}));
      for (int s = 0; s < 2; ++s) {
        const auto [x, y] = global_batch(s);
        sharded.zero_grad();
        model.forward(x.narrow(0, 2 * pg.rank(), 2), y.narrow(0, 2 * pg.rank(), 2)).loss.backward();
        sharded.step_on_device(1e-3);
      }
      {
        auto whole = sharded.summon_full_params();
        if (pg.rank() == 1)
          for (const auto& [name, p] : model.named_parameters()) result.summoned.emplace_back(name, p.to(kCPU).clone());
      }
      sharded.export_consolidated(file);
    });
    const SafetensorsFile exported(file);
    for (const std::string& name : exported.names()) result.exported.emplace_back(name, exported.read(name));
    return result;
  };
  const Result device = run(dist::Offload::none);
  const Result host = run(dist::Offload::optimizer_and_params);
  const Result optimizer_only = run(dist::Offload::optimizer);
  CHECK(!device.summoned.empty());
  CHECK(same_bits(host.summoned, device.summoned));
  CHECK(same_bits(optimizer_only.summoned, device.summoned));
  CHECK(same_bits(host.exported, device.exported));
  CHECK(same_bits(optimizer_only.exported, device.exported));
  std::filesystem::remove_all(folder);
}

TEST_CASE("offload settings that cannot work are refused with the reason") {
  dist::SingleRank one;
  auto build = [&](int stage, dist::Offload offload) {
    nn::GPT model(zero_config());
    dist::ShardedModel sharded(model, one, {.stage = stage, .offload = offload});
  };
  CHECK_THROWS_WITH_AS(build(0, dist::Offload::optimizer),
                       doctest::Contains("offload optimizer needs the optimizer state sharded: stage 1, 2 or 3"),
                       Error);
  CHECK_THROWS_WITH_AS(build(2, dist::Offload::optimizer_and_params),
                       doctest::Contains("offload optimizer+params needs stage 3"), Error);
  CHECK_THROWS_WITH_AS(dist::parse_offload("params"),
                       doctest::Contains("offload must be none, optimizer, optimizer+params or nvme, got 'params'"), Error);
  CHECK(dist::parse_offload("optimizer+params") == dist::Offload::optimizer_and_params);
  CHECK_THROWS_WITH_AS(empty({2}, TensorOptions().device(kCUDA).pinned()), doctest::Contains("host pool"), Error);
}

TEST_CASE("the host pool is an allocator of its own: pinned tensors are counted apart from other cpu memory") {
  Context rank;
  ContextGuard guard(rank);
  const int64_t before = memory_stats().allocated_total;
  {
    MemoryScope scope(MemoryCategory::optimizer_state);
    const Tensor t = ones({1000}, TensorOptions(DType::f32).pinned());
    CHECK(host_memory_stats()[MemoryCategory::optimizer_state] == 4000);
    CHECK(memory_stats().allocated_total == before);
    CHECK(sum(t * 2.0).item<double>() == 2000.0);  // an ordinary cpu tensor to every op
  }
  CHECK(host_memory_stats().allocated_total == 0);
  CHECK(host_memory_stats().peak_of(MemoryCategory::optimizer_state) == 4000);
}

}  // namespace zg::test

namespace zg::test {

TEST_CASE("accumulate_dtype f32: stages 2 and 3 sum the micro-batches' bf16 gradients in f32, not rounding each sum") {
  // Eight micro-batches of one sequence. The exact sum: each micro-batch's bf16 gradient
  // (stage 0, one rank: what every stage reduces), added in f64.
  constexpr int kMicro = 8;
  Context scratch;
  ContextGuard scratch_guard(scratch);
  manual_seed(7);
  const Tensor tokens = (rand({kMicro, kTime + 1}, DType::f64) * 64.0).to(DType::i64);
  const Tensor x = tokens.narrow(1, 0, kTime).contiguous(), y = tokens.narrow(1, 1, kTime).contiguous();
  auto backward = [&](nn::GPT& model, int k) {
    (model.forward(x.narrow(0, k, 1), y.narrow(0, k, 1)).loss * (1.0 / kMicro)).backward();
  };
  double exact_sq = 0;
  {
    Context rank;
    ContextGuard guard(rank);
    manual_seed(1);
    nn::GPT model(zero_config());
    dist::SingleRank one;
    dist::ShardedModel sharded(model, one, {.stage = 0, .compute_dtype = DType::bf16, .adamw = kAdamW});
    std::map<std::string, Tensor> sums;
    for (int k = 0; k < kMicro; ++k) {
      sharded.zero_grad();
      backward(model, k);
      for (const auto& [name, p] : model.named_parameters()) {
        const Tensor g = p.grad().to(DType::f64);
        const auto it = sums.find(name);
        if (it == sums.end()) sums.emplace(name, g.clone());
        else it->second = it->second + g;
      }
    }
    for (const auto& [name, s] : sums) exact_sq += sum(s * s).item<double>();
  }
  const double exact = std::sqrt(exact_sq);
  for (int stage : {2, 3})
    for (const std::optional<DType> accumulate : {std::optional<DType>(), std::optional<DType>(DType::f32)}) {
      Context rank;
      ContextGuard guard(rank);
      manual_seed(1);
      nn::GPT model(zero_config());
      dist::SingleRank one;
      dist::ShardedModel sharded(model, one, {.stage = stage, .compute_dtype = DType::bf16, .adamw = kAdamW,
                                              .accumulate_dtype = accumulate});
      sharded.zero_grad();
      for (int k = 0; k < kMicro; ++k) backward(model, k);
      INFO("stage " << stage << (accumulate ? std::string(" f32") : std::string(" bf16")) << " accumulation");
      // Its cost: the gradient shard's bytes (N = 1: every parameter, padded per unit).
      const int64_t shard_bytes = memory_stats()[MemoryCategory::gradient];
      CHECK(shard_bytes >= (accumulate ? 4 : 2) * sharded.num_parameters());
      CHECK(shard_bytes < (accumulate ? 4 : 2) * (sharded.num_parameters() + 8));
      const double error = std::abs(sharded.step(1e-3).grad_norm - exact) / exact;
      if (accumulate) CHECK(error < 1e-7);   // measured 5e-9: the f32 sums of bf16 values are exact
      else CHECK(error > 1e-5);              // measured 4.7e-4: each micro-batch's sum rounded to bf16
    }
  // Offloaded too (the host shard in f32), and refused where the full gradient accumulates.
  dist::run_local(2, [&](dist::ProcessGroup& pg) {
    manual_seed(1);
    nn::GPT model(zero_config());
    dist::ZeroConfig config = config_of({.stage = 3, .offload = dist::Offload::optimizer_and_params});
    config.accumulate_dtype = DType::f32;
    dist::ShardedModel sharded(model, pg, config);
    CHECK(host_memory_stats()[MemoryCategory::gradient] == 4 * (host_memory_stats()[MemoryCategory::optimizer_state] / 12));
  });
  dist::SingleRank one;
  nn::GPT model(zero_config());
  CHECK_THROWS_WITH_AS(dist::ShardedModel(model, one, {.stage = 1, .compute_dtype = DType::bf16, .accumulate_dtype = DType::f32}),
                       doctest::Contains("accumulate_dtype f32 needs stage 2 or 3"), Error);
}

}  // namespace zg::test

namespace zg::test {

namespace {

// Three steps of the tiny GPT, no clipping and no scaler: each unit's update during the
// backward (step_in_backward) or after it.
nn::NamedTensors train_updating(dist::ProcessGroup& pg, int stage, dist::Offload offload, DType dtype, bool early) {
  manual_seed(1);
  nn::GPT model(zero_config());
  dist::ShardedModel sharded(model, pg, {.stage = stage, .compute_dtype = dtype, .adamw = kAdamW,
                                         .max_grad_norm = 0, .offload = offload});
  const int64_t rows = kBatch / pg.size();
  for (int s = 0; s < 3; ++s) {
    const auto [x, y] = global_batch(s);
    sharded.zero_grad();
    if (early) sharded.step_in_backward(1e-3);
    model.forward(x.narrow(0, pg.rank() * rows, rows), y.narrow(0, pg.rank() * rows, rows)).loss.backward();
    sharded.step(1e-3);
  }
  nn::NamedTensors master;
  for (auto& [name, t] : sharded.gathered_master()) master.emplace_back(name, t.clone());
  return master;
}

}  // namespace

TEST_CASE("step_in_backward: each unit's AdamW during the backward gives the bits of the step after it (N = 1, 2; "
          "stages 1-3; offloaded or not)") {
  for (DType dtype : {DType::bf16, DType::f32})
    for (int n : {1, 2})
      for (int stage = 1; stage <= 3; ++stage)
        for (dist::Offload offload : {dist::Offload::none, dist::Offload::optimizer, dist::Offload::optimizer_and_params}) {
          if (offload == dist::Offload::optimizer_and_params && stage != 3) continue;
          INFO(std::string(name(dtype)) << " N=" << n << " stage " << stage << " offload " << dist::name(offload));
          nn::NamedTensors after, during;
          dist::run_local(n, [&](dist::ProcessGroup& pg) {
            nn::NamedTensors a = train_updating(pg, stage, offload, dtype, false);
            nn::NamedTensors d = train_updating(pg, stage, offload, dtype, true);
            if (pg.rank() == 0) after = std::move(a), during = std::move(d);
          });
          CHECK(same_bits(during, after));
        }
}

TEST_CASE("step_in_backward: a unit's CPU AdamW starts on its own thread before the backward has ended (the "
          "timeline's order), and what it cannot overlap is refused") {
  nn::GPTConfig deep = zero_config();
  deep.n_layer = 8, deep.n_embd = 64;
  dist::run_local(1, [&](dist::ProcessGroup& pg) {
    manual_seed(1);
    nn::GPT model(deep);
    dist::ShardedModel sharded(model, pg, {.stage = 2, .adamw = kAdamW, .max_grad_norm = 0,
                                           .offload = dist::Offload::optimizer});
    const Tensor x = (rand({8, 64}, DType::f64) * 64.0).to(DType::i64);
    bool overlapped = false;
    // A scheduling property: the worker must get a core while the backward goes on. Up to
    // five steps for one that shows it (each of seven blocks' backward takes milliseconds).
    for (int attempt = 0; attempt < 5 && !overlapped; ++attempt) {
      MemoryTimeline timeline;
      {
        MemoryTimelineRecording recording(timeline);
        sharded.zero_grad();
        sharded.step_in_backward(1e-3);
        model.forward(x, x).loss.backward();
        sharded.step(1e-3);
      }
      int64_t first_update = -1, last_backward = -1, updates = 0;
      const std::vector<TimelineEvent>& events = timeline.events();
      for (size_t i = 0; i < events.size(); ++i) {
        if (events[i].kind != TimelineEvent::Kind::begin) continue;
        const std::string& path = timeline.path(events[i].path);
        if (path.starts_with("adamw ") && path.find(" > ") == std::string::npos) {  // a unit's update, opened
          if (first_update < 0) first_update = static_cast<int64_t>(i);
          ++updates;
        }
        if (path.starts_with("backward")) last_backward = static_cast<int64_t>(i);  // "backward > h.0 (Block) > ..."
      }
      CHECK(updates == 9);  // the root and eight blocks, each once
      overlapped = first_update >= 0 && first_update < last_backward;
    }
    CHECK(overlapped);
  });
  // What step_in_backward refuses, each with its reason.
  dist::run_local(1, [&](dist::ProcessGroup& pg) {
    nn::GPT model(zero_config());
    dist::ShardedModel clipped(model, pg, {.stage = 2, .adamw = kAdamW, .max_grad_norm = 1.0});
    CHECK_THROWS_WITH_AS(clipped.step_in_backward(1e-3), doctest::Contains("clipping (max_grad_norm 1)"), Error);
  });
  dist::run_local(1, [&](dist::ProcessGroup& pg) {
    nn::GPT model(zero_config());
    dist::ShardedModel ddp(model, pg, {.stage = 0, .adamw = kAdamW, .max_grad_norm = 0});
    CHECK_THROWS_WITH_AS(ddp.step_in_backward(1e-3), doctest::Contains("DDP (stage 0)"), Error);
  });
  dist::run_local(1, [&](dist::ProcessGroup& pg) {
    nn::GPT model(zero_config());
    dist::ShardedModel sharded(model, pg, {.stage = 3, .adamw = kAdamW, .max_grad_norm = 0});
    sharded.step_in_backward(1e-3);
    CHECK_THROWS_WITH_AS(sharded.step(1e-3), doctest::Contains("0 of 3 units were updated"), Error);
    sharded.step_in_backward(2e-3);
    const auto [x, y] = global_batch(0);
    model.forward(x, y).loss.backward();
    CHECK_THROWS_WITH_AS(sharded.step(1e-3), doctest::Contains("step(0.001) after step_in_backward(0.002)"), Error);
  });
}

}  // namespace zg::test

namespace zg::test {

namespace {

struct DelayedRun {
  nn::NamedTensors master;
  std::vector<double> losses;
};

// `steps` steps of the tiny GPT (f32, offload optimizer), updates delayed after `after` of them (-1: never).
DelayedRun train_delayed(int n, int stage, int64_t after, int steps) {
  DelayedRun out;
  dist::run_local(n, [&](dist::ProcessGroup& pg) {
    manual_seed(1);
    nn::GPT model(zero_config());
    dist::ShardedModel sharded(model, pg, {.stage = stage, .adamw = kAdamW, .max_grad_norm = 1.0,
                                           .offload = dist::Offload::optimizer, .delayed_update_after = after});
    const int64_t rows = kBatch / pg.size();
    for (int s = 0; s < steps; ++s) {
      const auto [x, y] = global_batch(s);
      sharded.zero_grad();
      Tensor loss = model.forward(x.narrow(0, pg.rank() * rows, rows), y.narrow(0, pg.rank() * rows, rows)).loss;
      loss.backward();
      sharded.step(1e-2);
      Tensor global = loss.detach().reshape({1});
      pg.all_reduce(global, dist::ReduceKind::average);
      if (pg.rank() == 0) out.losses.push_back(global.item<double>());
    }
    nn::NamedTensors master;  // (lands the update in flight)
    for (auto& [name, t] : sharded.gathered_master()) master.emplace_back(name, t.clone());
    if (pg.rank() == 0) out.master = std::move(master);
  });
  return out;
}

}  // namespace

TEST_CASE("the delayed parameter update: exact until its step, then one update behind, alike at every N and stage, "
          "near the exact loss; refused where it cannot run") {
  const DelayedRun exact = train_delayed(1, 2, -1, 12);
  CHECK(same_bits(train_delayed(1, 2, 3, 3).master, train_delayed(1, 2, -1, 3).master));  // before `after`: exact
  const DelayedRun delayed = train_delayed(1, 2, 3, 12);
  CHECK_FALSE(same_bits(delayed.master, exact.master));
  for (int s = 0; s < 4; ++s) CHECK(delayed.losses[s] == exact.losses[s]);  // step 3's forward ran on step 2's weights, as exact
  CHECK(delayed.losses[4] != exact.losses[4]);                               // step 4's on weights one update behind
  CHECK(std::fabs(delayed.losses.back() - exact.losses.back()) < 0.05);
  // At N = 2 the gradients' sums round differently, and Adam divides by sqrt(v): after 12
  // steps at lr 1e-2 the exact update moves as far from N = 1 as the delayed one (bound: both).
  double exact_spread = 0;
  const DelayedRun exact_two = train_delayed(2, 2, -1, 12);
  for (size_t i = 0; i < exact.master.size(); ++i)
    exact_spread = std::max(exact_spread, max_abs_diff(exact_two.master[i].second, exact.master[i].second));
  MESSAGE("exact update, N = 2 against N = 1: " << exact_spread);
  for (int n : {1, 2})
    for (int stage = 1; stage <= 3; ++stage) {
      INFO("N=" << n << " stage " << stage);
      const DelayedRun other = train_delayed(n, stage, 3, 12);
      double spread = 0;
      for (size_t i = 0; i < other.master.size(); ++i)
        spread = std::max(spread, max_abs_diff(other.master[i].second, delayed.master[i].second));
      CHECK(spread <= (n == 1 ? 1e-6 : 2 * exact_spread + 1e-6));
    }
  dist::run_local(1, [&](dist::ProcessGroup& pg) {
    nn::GPT model(zero_config());
    for (dist::Offload offload : {dist::Offload::none, dist::Offload::optimizer_and_params})
      CHECK_THROWS_WITH_AS(dist::ShardedModel(model, pg, {.stage = 3, .offload = offload, .delayed_update_after = 0}),
                           doctest::Contains("delayed_update_after (the delayed parameter update) needs offload "
                                             "optimizer"), Error);
    dist::ShardedModel sharded(model, pg, {.stage = 2, .max_grad_norm = 0, .offload = dist::Offload::optimizer,
                                           .delayed_update_after = 0});
    CHECK_THROWS_WITH_AS(sharded.step_in_backward(1e-3), doctest::Contains("already runs the update"), Error);
    const auto [x, y] = global_batch(0);
    sharded.zero_grad();
    model.forward(x, y).loss.backward();
    CHECK_THROWS_WITH_AS(sharded.step_on_device(1e-3), doctest::Contains("step_on_device with the delayed"), Error);
  });
}

}  // namespace zg::test

namespace zg::test {

TEST_CASE("the delayed parameter update is the exact AdamW applied to gradients taken one update behind "
          "(emulated: a second model runs the forward on the weights before the latest update)") {
  constexpr int kAfter = 2, kSteps = 7;
  // The delayed run (f32, stage 1, offload optimizer, N = 1).
  nn::NamedTensors delayed;
  dist::run_local(1, [&](dist::ProcessGroup& pg) {
    manual_seed(1);
    nn::GPT model(zero_config());
    dist::ShardedModel sharded(model, pg, {.stage = 1, .adamw = kAdamW, .max_grad_norm = 0,
                                           .offload = dist::Offload::optimizer, .delayed_update_after = kAfter});
    for (int s = 0; s < kSteps; ++s) {
      const auto [x, y] = global_batch(s);
      sharded.zero_grad();
      model.forward(x, y).loss.backward();
      sharded.step(1e-2);
    }
    for (auto& [name, t] : sharded.gathered_master()) delayed.emplace_back(name, t.clone());
  });
  // The emulation: exact steps on `trained`, whose gradients come from `stale`, a model holding
  // the weights before the latest update once the delay has begun.
  nn::NamedTensors emulated;
  dist::run_local(1, [&](dist::ProcessGroup& pg) {
    manual_seed(1);
    nn::GPT trained(zero_config());
    manual_seed(1);
    nn::GPT stale(zero_config());
    dist::ShardedModel sharded(trained, pg, {.stage = 1, .adamw = kAdamW, .max_grad_norm = 0});
    nn::NamedTensors before = sharded.gathered_master();  // P_{k-1}
    for (int s = 0; s < kSteps; ++s) {
      const nn::NamedTensors now = sharded.gathered_master();  // P_k
      const nn::NamedTensors& weights = s <= kAfter ? now : before;
      {
        NoGradGuard no_grad;
        for (auto& [name, p] : stale.named_parameters())
          for (const auto& [wname, w] : weights)
            if (wname == name) p.copy_(w);
      }
      stale.zero_grad();
      const auto [x, y] = global_batch(s);
      stale.forward(x, y).loss.backward();
      sharded.zero_grad();
      {
        NoGradGuard no_grad;
        auto theirs = stale.named_parameters();
        for (auto& [name, p] : trained.named_parameters())
          for (auto& [sname, q] : theirs)
            if (sname == name) p.grad().copy_(q.grad());
      }
      sharded.step(1e-2);
      before = now;
    }
    for (auto& [name, t] : sharded.gathered_master()) emulated.emplace_back(name, t.clone());
  });
  REQUIRE(delayed.size() == emulated.size());
  for (size_t i = 0; i < delayed.size(); ++i) {
    INFO(delayed[i].first);
    CHECK(max_abs_diff(delayed[i].second, emulated[i].second) < 1e-6);
  }
}

}  // namespace zg::test

namespace zg::test {

TEST_CASE("activation offload: saved activations wait in the host pool between forward and backward, the device "
          "holds none of them, and the gradients are the same bits; an in-place write to one is still caught") {
  struct Pass {
    nn::NamedTensors grads;
    int64_t device_after_forward = 0, host_after_forward = 0;
  };
  const auto pass = [](bool offload) {
    Pass out;
    Context rank;
    ContextGuard guard(rank);
    manual_seed(1);
    nn::GPT model(zero_config());
    const auto [x, y] = global_batch(0);
    Tensor loss;
    {
      MemoryScope scope(MemoryCategory::activation);
      std::optional<OffloadSavedTensors> offloaded;
      if (offload) offloaded.emplace();
      loss = model.forward(x, y).loss;
    }
    out.device_after_forward = memory_stats()[MemoryCategory::activation];
    out.host_after_forward = host_memory_stats()[MemoryCategory::activation];
    {
      MemoryScope scope(MemoryCategory::activation);
      loss.backward();
    }
    for (const auto& [name, p] : model.named_parameters()) out.grads.emplace_back(name, p.grad().clone());
    return out;
  };
  const Pass kept = pass(false), offloaded = pass(true);
  CHECK(same_bits(offloaded.grads, kept.grads));
  CHECK(kept.host_after_forward == 0);
  CHECK(offloaded.host_after_forward > 0);
  // What stays on the device: the loss and what no op saved.
  CHECK(offloaded.device_after_forward < kept.device_after_forward / 10);
  MESSAGE("activations after the forward: kept " << kept.device_after_forward << " bytes on the device; offloaded "
                                                 << offloaded.device_after_forward << " on it, "
                                                 << offloaded.host_after_forward << " in the host pool");
  const Tensor w = randn({4}, DType::f64).set_requires_grad(true);
  Tensor a = w * 2.0, b;
  {
    OffloadSavedTensors offload;
    b = a * a;
  }
  {
    NoGradGuard no_grad;
    a.add_(ones_like(a));
  }
  CHECK_THROWS_WITH_AS(zg::sum(b).backward(), doctest::Contains("was modified in place after it was saved"), Error);
}

}  // namespace zg::test
