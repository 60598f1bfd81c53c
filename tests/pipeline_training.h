// What the pipeline training tests share (test_pipeline_training.cpp: GPT, checkpoints,
// precision; test_pipeline_llama.cpp: Llama): a GPT or a Llama cut into stages, each rank's
// chunks held by a ShardedModel over a pp x dp_shard [x tp] mesh (dist::join_chunks),
// trained through dist::Pipeline, against one rank -- each step's loss and gradient norm
// (clipped: the norm is the whole pipeline's) and in the end its weights.
#pragma once

#include <filesystem>
#include <map>
#include <mutex>
#include <optional>

#include "dist/comm/device_mesh.h"
#include "dist/comm/local_group.h"
#include "dist/pipeline/pipeline.h"
#include "dist/pipeline/stages.h"
#include "dist/tensor/parallelize.h"
#include "dist/zero/sharded_model.h"
#include "nn/llama.h"
#include "optim/grad_scaler.h"
#include "helpers.h"

namespace zg::test::pipeline_training {

using dist::ScheduleKind;

// Under AddressSanitizer a run costs ten times as much, and the sanitizers look for memory
// errors, which one micro-batch count per layout shows as well as three: the full matrix
// of m runs in the plain build.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif
inline std::vector<int> micro_batch_counts() { return kSanitized ? std::vector<int>{4} : std::vector<int>{1, 4, 8}; }


inline constexpr int kSteps = 5, kRows = 16, kSeq = 8;

enum class Arch { gpt, llama };

// How a run computes: f64 (exact comparisons), or bf16 with a loss scaler; blocks recomputed
// or not; at ZeRO-2 and 3, gradients reduced each micro-batch or once a step.
struct Mode {
  bool checkpointing = false, scaled_bf16 = false, reduce_once = false;
  DType weights() const { return scaled_bf16 ? DType::f32 : DType::f64; }
};

// Eight layers of either, alike on every rank (one seed).
inline std::unique_ptr<nn::CausalLM> make_model(Arch arch, Mode mode) {
  manual_seed(3);
  const TensorOptions options(mode.weights());
  if (arch == Arch::gpt) {
    nn::GPTConfig c;
    c.n_layer = 8, c.n_head = 2, c.n_embd = 8, c.vocab_size = 32, c.block_size = kSeq;
    c.activation_checkpointing = mode.checkpointing;
    return std::make_unique<nn::GPT>(c, options);
  }
  nn::LlamaConfig c;
  c.n_layer = 8, c.n_head = 2, c.n_kv_head = 2, c.n_embd = 8, c.intermediate_size = 16, c.vocab_size = 32;
  c.block_size = kSeq;
  return std::make_unique<nn::Llama>(c, options);
}

inline dist::Stages stages_of(nn::CausalLM& model, Arch arch, int stages) {
  return arch == Arch::gpt ? dist::gpt_stages(static_cast<nn::GPT&>(model), stages)
                           : dist::llama_stages(static_cast<nn::Llama&>(model), stages);
}

inline Tensor tokens(int64_t seed) {
  manual_seed(seed);
  return (rand({kRows, kSeq}, DType::f64) * 32.0).to(DType::i64);
}

inline dist::ZeroConfig config(int stage, Mode mode) {
  return {.stage = stage, .compute_dtype = mode.scaled_bf16 ? DType::bf16 : DType::f64, .adamw = {0.9, 0.95, 1e-8, 0.1},
          .max_grad_norm = 0.5, .reduce_once = mode.reduce_once};
}

inline std::optional<optim::GradScaler> scaler_for(Mode mode) {
  if (!mode.scaled_bf16) return std::nullopt;
  return optim::GradScaler({.init_scale = 1024});
}

struct Run {
  std::vector<double> losses, norms;
  std::map<std::string, Tensor> weights;  // the whole weights at the end, by name
  int64_t data_parallel_bytes = 0;         // rank 0's sent in its dp_shard group by the steps
};

// Steps [first, last), resumed from a save and saved at the end where named.
struct Span {
  int first = 0, last = kSteps;
  std::string resume = {}, save = {};
  void begin(dist::ShardedModel& sharded) const {
    if (!resume.empty()) sharded.load(resume);
    CHECK(sharded.steps() == first);
  }
  void end(dist::ShardedModel& sharded) const {
    if (!save.empty()) sharded.save(save);
  }
};

// One rank: the whole model, the whole batch.
inline Run one_rank(Arch arch, const Span& span = {}, Mode mode = {}) {
  Run run;
  dist::run_local(1, [&](dist::ProcessGroup& group) {
    const std::unique_ptr<nn::CausalLM> model = make_model(arch, {.scaled_bf16 = mode.scaled_bf16});
    dist::ShardedModel sharded(*model, group, config(0, mode));
    std::optional<optim::GradScaler> scaler = scaler_for(mode);
    span.begin(sharded);
    for (int step = span.first; step < span.last; ++step) {
      sharded.zero_grad();
      const Tensor loss = model->forward(tokens(100 + step), tokens(200 + step)).loss;
      (scaler ? loss * scaler->scale_factor() : loss).backward();
      run.losses.push_back(loss.item<double>());
      run.norms.push_back(sharded.step(1e-2, scaler ? &*scaler : nullptr).grad_norm);
    }
    span.end(sharded);
    for (const auto& [name, w] : sharded.consolidated_state()) run.weights[name] = w;
  });
  return run;
}

struct Layout {
  Arch arch;
  ScheduleKind kind;
  int p, m, v, dp, stage, tp = 1;
  Mode mode = {};
};

// p x dp x tp ranks as threads: pp outermost, each dp rank taking its rows of the batch,
// the GPT cut across each tp group first.
inline Run pipelined(const Layout& l, const Span& span = {}) {
  Run run;
  std::mutex mutex;
  std::map<std::string, int> holders;
  dist::run_local(l.p * l.dp * l.tp, [&](dist::ProcessGroup& world) {
    std::vector<dist::MeshDim> dims{{"pp", l.p}, {"dp_shard", l.dp}};
    if (l.tp > 1) dims.push_back({"tp", l.tp});
    dist::DeviceMesh mesh(world, dims);
    const std::unique_ptr<nn::CausalLM> model = make_model(l.arch, l.mode);
    if (l.tp > 1) dist::parallelize_module(*model, mesh.group("tp"), model->parallel_plan());
    const dist::Schedule schedule = dist::make_schedule(l.kind, l.p, l.m, l.v);
    const dist::Stages stages = stages_of(*model, l.arch, schedule.stages());
    const auto chunks = stages.chunks(schedule, mesh.coordinate("pp"));
    const auto held = dist::join_chunks(chunks);
    dist::ShardedModel sharded(*held, mesh, config(l.stage, l.mode));
    std::optional<optim::GradScaler> scaler = scaler_for(l.mode);
    dist::Pipeline pipeline(mesh.group("pp"), schedule, chunks, stages.loss);
    const int64_t rows = kRows / l.dp, first = mesh.coordinate("dp_shard") * rows;
    std::vector<double> losses, norms;
    span.begin(sharded);
    mesh.group("dp_shard").reset_bytes_sent();  // the steps' (not the build's broadcast)
    for (int step = span.first; step < span.last; ++step) {
      sharded.zero_grad();
      const Tensor loss = full({1}, pipeline.run(tokens(100 + step).narrow(0, first, rows),
                                                 tokens(200 + step).narrow(0, first, rows),
                                                 scaler ? scaler->scale_factor() : 1.0), DType::f64);
      mesh.group("dp_shard").all_reduce(loss, dist::ReduceKind::average);
      losses.push_back(loss.item<double>());
      norms.push_back(sharded.step(1e-2, scaler ? &*scaler : nullptr).grad_norm);
    }
    span.end(sharded);
    const nn::NamedTensors weights = sharded.consolidated_state();
    std::lock_guard lock(mutex);
    if (world.rank() == 0) run.data_parallel_bytes = mesh.group("dp_shard").bytes_sent();
    if (run.losses.empty()) run.losses = losses, run.norms = norms;
    CHECK(losses == run.losses);  // every rank returns the same loss
    for (const auto& [name, w] : weights) {
      const std::string parameter = name;  // (Clang: INFO cannot capture a structured binding)
      INFO(parameter << " on rank " << world.rank());
      if (run.weights.contains(parameter)) CHECK(max_abs_diff(run.weights[parameter], w) == 0.0);  // the same on each holder
      run.weights[parameter] = w;
    }
  });
  return run;
}

// The steps of `got` are those of `want` from its step `first` on.
inline void check_same_steps(const Run& got, const Run& want, size_t first = 0) {
  REQUIRE(got.losses.size() + first == want.losses.size());
  for (size_t step = 0; step < got.losses.size(); ++step) {
    INFO("step " << first + step + 1);
    CHECK(got.losses[step] == doctest::Approx(want.losses[first + step]).epsilon(1e-12));
    CHECK(got.norms[step] == doctest::Approx(want.norms[first + step]).epsilon(1e-12));
  }
  REQUIRE(got.weights.size() == want.weights.size());  // the last stage's copy of wte under its name
  for (const auto& [name, w] : got.weights) {
    const std::string parameter = name;
    INFO(parameter);
    CHECK(max_abs_diff(w, want.weights.at(parameter)) < 1e-12);
  }
}

// Every schedule at p in {2, 4}, m in {1, 4, 8}, each of `layouts` (dp, ZeRO stage, tp).
inline void check_every_schedule(Arch arch, std::initializer_list<std::tuple<int, int, int>> layouts) {
  const Run want = one_rank(arch);
  for (ScheduleKind kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved,
                            ScheduleKind::zb_h1, ScheduleKind::zb_h2})
    for (int p : {2, 4})
      for (int m : micro_batch_counts())
        for (const auto& layout : layouts) {
          const auto [dp, stage, tp] = layout;
          const int dp_ranks = dp, zero_stage = stage, tp_ranks = tp;  // (Clang: INFO cannot capture a structured binding)
          const int v = kind == ScheduleKind::interleaved ? 2 : 1;
          const bool zero_bubble = kind == ScheduleKind::zb_h1 || kind == ScheduleKind::zb_h2;
          if ((v > 1 && m % p != 0) || (zero_bubble && stage == 3)) continue;  // (ZeRO-3: refused, below)
          if (stage >= 2 && m != 4) continue;  // ZeRO-2 and 3: one m (the suite's time)
          INFO(std::string(dist::name(kind)) << " p=" << p << " m=" << m << " dp=" << dp_ranks << " ZeRO stage "
                                             << zero_stage << " tp=" << tp_ranks);
          check_same_steps(pipelined({arch, kind, p, m, v, dp, stage, tp}), want);
        }
  // One rank holding both ends: no tie, the embedding in the root unit as in the model's own
  // plan (ZeRO-3 gathers it for the embedding and keeps it for the head).
  for (int stage : {0, 3}) {
    INFO("interleaved over 4 chunks on one pp rank, dp=2, ZeRO stage " << stage);
    check_same_steps(pipelined({arch, ScheduleKind::interleaved, 1, 4, 4, 2, stage}), want);
  }
}

}  // namespace zg::test::pipeline_training
