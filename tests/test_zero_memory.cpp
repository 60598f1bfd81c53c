// ZeRO's memory and traffic: model-state bytes per rank equal the ZeRO paper's formulas
// (real ranks, and meta dry runs up to 7.5B parameters), bytes sent per step, no growth
// step after step, a deferred build, and a dry run's step log, step model and schedule.
#include "dist/comm/fake_group.h"
#include "dist/comm/local_group.h"
#include "dist/comm/step_model.h"
#include "dist/zero/sharded_model.h"
#include "helpers.h"
#include "tensor/deferred.h"
#include "tensor/step_log.h"
#include "zero_training.h"

#include <map>
#include <optional>
#include <set>

namespace zg::test {

// Model states of rank 0 of N on the meta device with a fake group: nothing allocated.
static int64_t dry_run_model_states(const nn::GPTConfig& config, int n, int stage, int64_t& psi) {
  Context rank0;
  ContextGuard guard(rank0);
  dist::FakeGroup group(0, n);
  nn::GPT model(config, kMeta);
  dist::ShardedModel sharded(model, group, {.stage = stage, .compute_dtype = DType::bf16, .adamw = kAdamW});
  psi = sharded.num_parameters();
  const MemoryStats s = memory_stats(kMeta);
  return s[MemoryCategory::parameter] + s[MemoryCategory::gradient] + s[MemoryCategory::optimizer_state];
}

// One step of rank 0 of N on the meta device: bytes sent, and the peak of gathered units.
static std::pair<int64_t, int64_t> dry_run_step(const nn::GPTConfig& config, int n, int stage, int prefetch,
                                                int64_t& psi) {
  Context rank0;
  ContextGuard guard(rank0);
  dist::FakeGroup group(0, n);
  nn::GPT model(config, kMeta);
  dist::ShardedModel sharded(model, group,
                             {.stage = stage, .compute_dtype = DType::bf16, .adamw = kAdamW, .prefetch = prefetch});
  psi = sharded.num_parameters();
  const Tensor ids = zeros({1, 64}, TensorOptions(DType::i64).device(kMeta));
  sharded.zero_grad();
  group.reset_bytes_sent();
  model.forward(ids, ids).loss.backward();
  sharded.step(1e-3);
  return {group.bytes_sent(), memory_stats(kMeta).peak_of(MemoryCategory::communication)};
}

TEST_CASE("building a deferred model sharded holds no more than the rank's model states and one unit") {
  // ZeRO-3 at N = 8 on the meta device: each rank allocates its shards and at most one
  // unit's full buffer at a time; an eager build held the whole f32 model first.
  for (int stage = 0; stage <= 3; ++stage) {
    INFO("stage " << stage);
    Context rank(3);
    ContextGuard guard(rank);
    dist::FakeGroup group(3, 8);
    std::optional<nn::GPT> model;
    {
      DeferredInit deferred;
      model.emplace(zero_config(), kMeta);
    }
    dist::ShardedModel sharded(*model, group, {.stage = stage, .compute_dtype = DType::bf16});
    const MemoryStats stats = memory_stats(kMeta);
    const int64_t states = stats[MemoryCategory::parameter] + stats[MemoryCategory::gradient] +
                           stats[MemoryCategory::optimizer_state];
    int64_t largest_unit = 0;  // bf16 weights of a block, padded
    for (const auto& [name, p] : model->h->at<nn::Block>(0).named_parameters()) largest_unit += 2 * p.numel();
    largest_unit = std::max<int64_t>(largest_unit, 2 * (model->wte->weight.numel() + model->wpe->weight.numel() + 2 * 32));
    CHECK(stats.peak_total <= states + largest_unit + 8 * 16);
  }
}

TEST_CASE("model-state bytes per rank after backward equal the ZeRO formulas (bf16 compute)") {
  for (int n : {1, 2, 4, 8})
    for (int stage = 0; stage <= 3; ++stage) {
      INFO("N=" << n << " stage " << stage);
      std::vector<int64_t> states(n), expected(n);
      dist::run_local(n, [&](dist::ProcessGroup& pg) {
        manual_seed(1);
        nn::GPT model(zero_config());
        dist::ShardedModel sharded(model, pg, {.stage = stage, .compute_dtype = DType::bf16, .adamw = kAdamW, .max_grad_norm = 1.0});
        // P = padded parameter count (each unit padded to a multiple of N)
        int64_t padded = 0;
        for (const std::string unit : {"root", "transformer.h.0", "transformer.h.1"}) {
          int64_t count = 0;
          for (const auto& [name, p] : model.named_parameters()) {
            const bool in_block = name.starts_with("transformer.h.");
            if ((unit == std::string("root") && !in_block) || (in_block && name.starts_with(std::string(unit) + ".")))
              count += p.numel();
          }
          padded += (count + n - 1) / n * n;
        }
        const auto [x, y] = global_batch(0);
        sharded.zero_grad();
        model.forward(x.narrow(0, 0, 1), y.narrow(0, 0, 1)).loss.backward();
        const MemoryStats s = memory_stats();
        if (stage == 3) {  // every gathered unit was released again, but units were gathered
          CHECK(s[MemoryCategory::communication] == 0);
          CHECK(s.peak_of(MemoryCategory::communication) > 0);
        }
        states[pg.rank()] = s[MemoryCategory::parameter] + s[MemoryCategory::gradient] +
                            s[MemoryCategory::optimizer_state];
        const int64_t per_rank = padded / n;
        expected[pg.rank()] = stage == 0   ? 16 * padded
                              : stage == 1 ? 4 * padded + 12 * per_rank
                              : stage == 2 ? 2 * padded + 14 * per_rank
                                           : 16 * per_rank;
        sharded.step(1e-3);
      });
      CHECK(states == expected);
    }
}

TEST_CASE("GPT-2 124M: bytes sent per step equal 2Ψ (stages 0-2) and 3Ψ (stage 3) elements, ring-counted, within 1%") {
  const nn::GPTConfig gpt2;
  for (int n : {2, 4, 8})
    for (int stage = 0; stage <= 3; ++stage) {
      int64_t psi = 0;
      const double sent = static_cast<double>(dry_run_step(gpt2, n, stage, 1, psi).first);
      const double formula = (stage == 3 ? 3.0 : 2.0) * psi * 2 /* bf16 bytes */ * (n - 1) / n;
      INFO("N=" << n << " stage " << stage << ": " << sent << " bytes, formula " << formula);
      CHECK(sent >= formula);  // padding only adds
      CHECK((sent - formula) / formula < 0.01);
    }
  // Prefetching holds more gathered units at once; the traffic stays the same.
  int64_t psi = 0;
  const auto [sent0, peak0] = dry_run_step(gpt2, 8, 3, 0, psi);
  const auto [sent2, peak2] = dry_run_step(gpt2, 8, 3, 2, psi);
  CHECK(sent0 == sent2);
  CHECK(peak2 > peak0);
}

TEST_CASE("the meta dry run reproduces the ZeRO paper's example: 7.5B parameters at N = 64") {
  nn::GPTConfig c;  // 36 x 4096 with a 60,000-token vocabulary: 7,499,636,736 parameters
  c.n_layer = 36, c.n_head = 32, c.n_embd = 4096, c.vocab_size = 60000, c.block_size = 1024;
  const double paper_gb[] = {120.0, 31.4, 16.6, 1.9};
  for (int stage = 0; stage <= 3; ++stage) {
    int64_t psi = 0;
    const double gb = static_cast<double>(dry_run_model_states(c, 64, stage, psi)) / 1e9;
    INFO("stage " << stage << ": " << gb << " GB");
    CHECK(std::fabs(psi - 7.5e9) / 7.5e9 < 1e-4);
    CHECK(std::round(gb * 10) / 10 == doctest::Approx(paper_gb[stage]));
  }
}

TEST_CASE("GPT-2 124M: model states equal the formulas up to padding (< 0.5%) for N = 1, 2, 4, 8") {
  const nn::GPTConfig gpt2;
  for (int n : {1, 2, 4, 8})
    for (int stage = 0; stage <= 3; ++stage) {
      int64_t psi = 0;
      const int64_t states = dry_run_model_states(gpt2, n, stage, psi);
      const double formula = stage == 0   ? 16.0 * psi
                             : stage == 1 ? 4.0 * psi + 12.0 * psi / n
                             : stage == 2 ? 2.0 * psi + 14.0 * psi / n
                                          : 16.0 * psi / n;
      INFO("N=" << n << " stage " << stage);
      CHECK(states >= formula);
      CHECK((states - formula) / formula < 0.005);
    }
}

TEST_CASE("stages 2 and 3 with gradient sync off hold the full gradient between micro-batches and reduce once") {
  // Rank 0 of 8 on the meta device, bf16 compute, 4 micro-batches: sync off for the first
  // three keeps every unit's full gradient (in the accumulate dtype: bf16, or f32 when
  // wider) and drops three of the four reduce-scatters, (N - 1)/N x padded x 2 bytes each.
  constexpr int n = 8, micro = 4;
  for (int stage : {2, 3})
    for (DType accumulate : {DType::bf16, DType::f32}) {
      INFO("stage " << stage << ", accumulate " << name(accumulate));
      int64_t held[2], sent[2], shard_bytes = 0;
      for (bool sync_every : {true, false}) {
        Context rank0;
        ContextGuard guard(rank0);
        dist::FakeGroup group(0, n);
        nn::GPT model(zero_config(), kMeta);
        dist::ShardedModel sharded(model, group, {.stage = stage, .compute_dtype = DType::bf16,
                                                  .accumulate_dtype = accumulate});
        const Tensor ids = zeros({1, 16}, TensorOptions(DType::i64).device(kMeta));
        sharded.zero_grad();
        shard_bytes = memory_stats(kMeta)[MemoryCategory::gradient];  // the gradient shard alone
        group.reset_bytes_sent();
        for (int k = 0; k < micro; ++k) {
          sharded.set_gradient_sync(sync_every || k == micro - 1);
          model.forward(ids, ids).loss.backward();
          if (k == 0) held[sync_every] = memory_stats(kMeta)[MemoryCategory::gradient];
        }
        sent[sync_every] = group.bytes_sent();
        CHECK(memory_stats(kMeta)[MemoryCategory::gradient] == shard_bytes);  // the full gradients freed at the sync
        sharded.step(1e-3);
      }
      const int64_t padded = n * shard_bytes / element_size(accumulate);  // every unit's, elements
      CHECK(held[true] == shard_bytes);
      CHECK(held[false] == shard_bytes + padded * element_size(accumulate));
      CHECK(sent[true] - sent[false] == (micro - 1) * (n - 1) * padded / n * 2);
    }
}

TEST_CASE("memory does not grow step after step, at any stage") {
  for (int stage = 0; stage <= 3; ++stage) {
    INFO("stage " << stage);
    dist::run_local(2, [&](dist::ProcessGroup& pg) {
      ZeroRun run{.dtype = DType::bf16, .stage = stage, .micro_batches = 2};
      manual_seed(1);
      nn::GPT model(zero_config(stage == 3));
      dist::ShardedModel sharded(model, pg, run.config());
      std::vector<MemoryStats> after;
      for (int s = 0; s < 8; ++s) {
        const auto [x, y] = global_batch(s);
        sharded.zero_grad();
        for (int k = 0; k < 2; ++k) {
          sharded.set_gradient_sync(k == 1);
          model.forward(x.narrow(0, 2 * pg.rank() + k, 1), y.narrow(0, 2 * pg.rank() + k, 1)).loss.backward();
        }
        sharded.step(1e-3);
        after.push_back(memory_stats());
      }
      // Every category, byte for byte. (Peaks may differ by a scratch buffer: a
      // collective's buffers are freed on the communication worker, in its own time.)
      for (int s = 2; s < 8; ++s) CHECK(after[s].allocated == after[1].allocated);
      CHECK(after.back()[MemoryCategory::communication] == 0);
      CHECK(after.back()[MemoryCategory::activation] == 0);
    });
  }
}

TEST_CASE("a meta dry run gives the same figures, peaks included, every time") {
  const auto peaks = [](int stage) {
    Context rank0;
    ContextGuard guard(rank0);
    dist::FakeGroup group(0, 8);
    nn::GPT model(nn::GPTConfig{}, kMeta);
    dist::ShardedModel sharded(model, group, {.stage = stage, .compute_dtype = DType::bf16});
    const Tensor ids = zeros({1, 64}, TensorOptions(DType::i64).device(kMeta));
    sharded.zero_grad();
    model.forward(ids, ids).loss.backward();
    sharded.step(1e-3);
    const MemoryStats s = memory_stats(kMeta);
    return std::vector<int64_t>{s.peak_total, s.peak_of(MemoryCategory::communication), s.peak_of(MemoryCategory::gradient)};
  };
  for (int stage = 0; stage <= 3; ++stage) {
    INFO("stage " << stage);
    const std::vector<int64_t> first = peaks(stage);
    for (int again = 0; again < 3; ++again) CHECK(peaks(stage) == first);
  }
}

TEST_CASE("a dry run's step log holds its kernels' FLOPs and its collectives; the step model replays them") {
  // GPT-2 124M, ZeRO-3 at N = 8, one sequence of 1024: the matrix products' FLOPs are
  // 6 x (Ψ without the position table) x tokens, plus attention's 2 T^2 C a layer forward
  // (causal) and 2.5 times that backward.
  nn::GPTConfig gpt2;
  Context rank0;
  ContextGuard guard(rank0);
  dist::FakeGroup group(0, 8);
  nn::GPT model(gpt2, kMeta);
  dist::ShardedModel sharded(model, group, {.stage = 3, .compute_dtype = DType::bf16, .adamw = kAdamW});
  const Tensor ids = zeros({1, 1024}, TensorOptions(DType::i64).device(kMeta));
  StepLog log;
  group.reset_bytes_sent();
  {
    StepLogScope recording(log);
    sharded.zero_grad();
    model.forward(ids, ids).loss.backward();
    sharded.step(1e-3);
  }
  double flops = 0, sent = 0;
  int issued = 0;
  std::set<int64_t> open;
  for (const StepEvent& e : log.events) {
    if (e.kind == StepEvent::Kind::compute) flops += e.flops;
    if (e.kind == StepEvent::Kind::issue) sent += e.sent, open.insert(e.collective), ++issued;
    if (e.kind == StepEvent::Kind::wait) CHECK(open.contains(e.collective));  // waits for what was issued
  }
  const double T = 1024, C = 768, L = 12;
  const double expected = 6.0 * static_cast<double>(sharded.num_parameters() - 1024 * 768) * T + 3.5 * 2 * T * T * C * L;
  CHECK(flops == doctest::Approx(expected).epsilon(0.02));
  CHECK(sent == static_cast<double>(group.bytes_sent()));
  CHECK(issued > 3 * 13);  // every unit gathered twice and reduced once, and the agreements

  // The model on a log of its own: 4 s of compute, an all-reduce issued, 4 s more, then a wait.
  const auto replay = [](double bytes, int group_size) {
    StepLog synthetic;
    const int group_id = 0;
    synthetic.compute(4e12, 0);
    const int64_t id = synthetic.issue(static_cast<int>(dist::CollectiveOp::all_reduce), bytes, &group_id, group_size, 1);
    synthetic.compute(4e12, 0);
    synthetic.wait(id);
    const dist::Machine machine{.flops_per_second = 1e12, .memory_bytes_per_second = 1e12, .kernel_seconds = 0,
                                .ranks_per_node = 8, .intra_bytes_per_second = 1e9, .intra_latency_seconds = 0.5,
                                .inter_bytes_per_second = 1e8, .inter_latency_seconds = 0};
    return dist::predict(synthetic, machine);
  };
  // Within a node: 2 x log2(8) = 6 latencies (log-depth beats the ring's 14) + 1 s: hidden by the second 4 s.
  const dist::StepTime hidden = replay(1e9, 8);
  CHECK(hidden.step == doctest::Approx(8));
  CHECK(hidden.communication == doctest::Approx(4));
  CHECK(hidden.exposed == doctest::Approx(0));
  // Across nodes (16 ranks): 1e9 bytes at 1e8 B/s take 10 s from t = 4: 6 s exposed.
  const dist::StepTime exposed = replay(1e9, 16);
  CHECK(exposed.step == doctest::Approx(14));
  CHECK(exposed.exposed == doctest::Approx(6));
  CHECK_THROWS_WITH_AS(dist::predict(log, {.flops_per_second = 0}), doctest::Contains("step model: every rate must be positive"),
                       Error);
}

// The schedule predict() keeps (what --schedule-svg draws), for DDP with 4 MiB buckets
// and ZeRO-3 with prefetch, GPT-2 124M at N = 64 (across nodes: communication shows):
// each row in order, a collective no earlier than the compute that issued it, compute
// no earlier than the collective it waited for, and the compute row's idle time exactly
// the exposed time.
TEST_CASE("offload in the step log: the CPU AdamW's bytes on the host, the gradient down and the weights up over the "
          "link, the file tier's reads and writes on the disk; the model adds each at its rate") {
  struct Expected {
    dist::Offload offload;
    int stage;
    double host, link;  // bytes a parameter
    bool disk;
  };
  // Host: AdamW's 26 (master, m, v read and written, the bf16 gradient read), and the gradient
  // shard's zeroing (2) and arrival -- ZeRO-1 copies it (2), ZeRO-2 adds it (4); at ZeRO-3 with
  // the file tier the zeroing is a mark (0) and each of the two gathers reads the f32 master (8).
  // Link: the gradient down (2) and the new bf16 weights up (2); at ZeRO-3 the bf16 casts of two
  // gathers (4) and the gradient (2).
  for (const Expected& x : {Expected{dist::Offload::none, 1, 0, 0, false}, Expected{dist::Offload::optimizer, 1, 30, 4, false},
                            Expected{dist::Offload::optimizer, 2, 32, 4, false},
                            Expected{dist::Offload::nvme, 3, 38, 6, true}}) {
    INFO(std::string(dist::name(x.offload)) << " stage " << x.stage);
    Context rank0;
    ContextGuard guard(rank0);
    dist::FakeGroup group(0, 1);
    nn::GPT model(zero_config(), kMeta);
    dist::ShardedModel sharded(model, group, {.stage = x.stage, .compute_dtype = DType::bf16, .offload = x.offload});
    const double psi = static_cast<double>(sharded.num_parameters());
    const Tensor ids = zeros({1, 16}, TensorOptions(DType::i64).device(kMeta));
    StepLog log;
    for (int s = 0; s < 2; ++s) {  // the second step, as --simulate reads it
      log.clear();
      StepLogScope recording(log);
      sharded.zero_grad();
      model.forward(ids, ids).loss.backward();
      sharded.step(1e-3);
    }
    double host = 0, link = 0, disk = 0;
    for (const StepEvent& e : log.events) {
      if (e.kind == StepEvent::Kind::host) host += e.bytes;
      if (e.kind == StepEvent::Kind::link) link += e.bytes;
      if (e.kind == StepEvent::Kind::disk) disk += e.bytes;
    }
    CHECK(host == doctest::Approx(x.host * psi).epsilon(0.01));
    CHECK(link == doctest::Approx(x.link * psi).epsilon(0.01));
    // The file tier: the state read for the update and written back, the master read for each gather.
    CHECK((disk > 14 * psi) == x.disk);
    const dist::Machine machine{.host_bytes_per_second = 1e9, .link_bytes_per_second = 1e8, .disk_bytes_per_second = 1e7};
    const dist::StepTime t = dist::predict(log, machine);
    CHECK(t.host == doctest::Approx(host / 1e9));
    CHECK(t.link == doctest::Approx(link / 1e8));
    CHECK(t.disk == doctest::Approx(disk / 1e7));
    CHECK(t.step == doctest::Approx(t.compute + t.offload() + t.exposed));
  }
}

TEST_CASE("the step model's host thread: a task runs beside the compute stream from its queue; a join waits") {
  const dist::Machine machine{.flops_per_second = 1e12, .memory_bytes_per_second = 1e12, .kernel_seconds = 0,
                              .host_bytes_per_second = 1, .link_bytes_per_second = 1, .disk_bytes_per_second = 1};
  // 2 s of compute, a task queued (the CPU 2 s, then the link 1 s), 2 s more, a join: the stream waits 1 s.
  StepLog log;
  log.compute(2e12, 0);
  const std::shared_ptr<StepLog> task = log.queue();
  task->offload(StepEvent::Kind::host, 2);
  task->offload(StepEvent::Kind::link, 1);
  log.compute(2e12, 0);
  log.join();
  const dist::StepTime t = dist::predict(log, machine);
  CHECK(t.step == doctest::Approx(5));
  CHECK(t.compute == doctest::Approx(4));
  CHECK(t.worker == doctest::Approx(3));
  CHECK(t.host == doctest::Approx(2));
  CHECK(t.link == doctest::Approx(1));
  CHECK(t.offload_held == 0);
  CHECK(t.exposed == doctest::Approx(1));
  REQUIRE(t.task_spans.size() == 2);
  CHECK(t.task_spans[0].start == doctest::Approx(2));
  CHECK(t.task_spans[1].end == doctest::Approx(5));
  // The same work on the training thread holds the stream: 2 + 3 + 2 s.
  StepLog serial;
  serial.compute(2e12, 0);
  serial.offload(StepEvent::Kind::host, 2);
  serial.offload(StepEvent::Kind::link, 1);
  serial.compute(2e12, 0);
  const dist::StepTime held = dist::predict(serial, machine);
  CHECK(held.step == doctest::Approx(7));
  CHECK(held.offload_held == doctest::Approx(3));
  CHECK(held.worker == 0);
  CHECK(held.exposed == doctest::Approx(0));
  // Two tasks queued together run one after the other on the one thread.
  StepLog two;
  two.queue()->offload(StepEvent::Kind::host, 2);
  two.queue()->offload(StepEvent::Kind::disk, 2);
  two.compute(1e12, 0);
  two.join();
  const dist::StepTime both = dist::predict(two, machine);
  CHECK(both.task_spans.at(1).start == doctest::Approx(2));
  CHECK(both.step == doctest::Approx(4));
  CHECK(both.disk == doctest::Approx(2));
  // The delayed update: queued after the step's last join, the task is the next step's; the copy
  // the step before queued runs from the start and the join waits for it (3 s, joined at 2 s).
  StepLog delayed;
  delayed.compute(2e12, 0);
  delayed.join();
  delayed.compute(1e12, 0);
  delayed.queue()->offload(StepEvent::Kind::host, 3);
  const dist::StepTime dpu = dist::predict(delayed, machine);
  CHECK(dpu.task_spans.at(0).start == 0);
  CHECK(dpu.step == doctest::Approx(4));
  CHECK(dpu.exposed == doctest::Approx(1));
  CHECK(dpu.worker == doctest::Approx(3));
  // A task that issues a collective is refused by name.
  StepLog odd;
  const int group_id = 0;
  odd.queue()->issue(static_cast<int>(dist::CollectiveOp::all_reduce), 1, &group_id, 2, 1);
  odd.join();
  CHECK_THROWS_WITH_AS(dist::predict(odd, machine), doctest::Contains("a host thread's task issued a collective"),
                       Error);
}

TEST_CASE("a dry run of the update in the backward: each unit's CPU AdamW a task queued as its gradient lands") {
  Context rank0;
  ContextGuard guard(rank0);
  dist::FakeGroup group(0, 1);
  nn::GPT model(zero_config(), kMeta);
  dist::ShardedModel sharded(model, group,
                             {.stage = 1, .compute_dtype = DType::bf16, .offload = dist::Offload::optimizer});
  const Tensor ids = zeros({1, 16}, TensorOptions(DType::i64).device(kMeta));
  StepLog serial, early;
  size_t forward_end = 0, backward_end = 0;
  for (int s = 0; s < 4; ++s) {  // two steps each way; the second of each recorded
    const bool in_backward = s >= 2;
    StepLog& log = in_backward ? early : serial;
    log.clear();
    StepLogScope recording(log);
    sharded.zero_grad();
    if (in_backward) sharded.step_in_backward(1e-3);
    const Tensor loss = model.forward(ids, ids).loss;
    forward_end = log.events.size();
    loss.backward();
    backward_end = log.events.size();
    sharded.step(1e-3);
  }
  const size_t units = static_cast<size_t>(zero_config().n_layer) + 1;  // a unit a block, and the root
  CHECK(serial.tasks.empty());
  REQUIRE(early.tasks.size() == units);
  size_t in_backward = 0, last_queue = 0, join = 0;
  for (size_t i = 0; i < early.events.size(); ++i) {
    if (early.events[i].kind == StepEvent::Kind::queue) {
      CHECK(i >= forward_end);
      in_backward += i < backward_end, last_queue = i;
    }
    if (early.events[i].kind == StepEvent::Kind::join) join = i;
  }
  CHECK(in_backward + 2 >= units);  // all but the two reductions step() finishes
  CHECK(join > last_queue);
  // The same bytes of AdamW on the CPU, most of them beside the backward: a shorter step.
  const dist::Machine machine{.host_bytes_per_second = 1e9, .link_bytes_per_second = 1e8};
  const dist::StepTime after = dist::predict(serial, machine), during = dist::predict(early, machine);
  CHECK(during.host == doctest::Approx(after.host));
  CHECK(during.link == doctest::Approx(after.link));
  CHECK(during.worker > 0.5 * during.host);
  CHECK(during.offload_held < after.offload_held);
  CHECK(during.step < after.step);
  CHECK(during.step == doctest::Approx(during.compute + during.offload_held + during.exposed));
}

TEST_CASE("the step model's schedule: rows in order, collectives after what issued them, idle compute = exposed") {
  for (int stage : {0, 3}) {
    INFO("stage " << stage);
    nn::GPTConfig gpt2;
    Context rank0;
    ContextGuard guard(rank0);
    dist::FakeGroup group(0, 64);
    nn::GPT model(gpt2, kMeta);
    dist::ShardedModel sharded(model, group, {.stage = stage, .compute_dtype = DType::bf16, .adamw = kAdamW,
                                              .bucket_bytes = 4 << 20});
    const Tensor ids = zeros({1, 256}, TensorOptions(DType::i64).device(kMeta));
    StepLog log;
    {
      StepLogScope recording(log);
      log.mark("forward");
      sharded.zero_grad();
      const Tensor loss = model.forward(ids, ids).loss;
      log.mark("backward");
      loss.backward();
      log.mark("optimizer");
      sharded.step(1e-3);
    }
    REQUIRE(log.marks.size() == 3);
    CHECK(log.marks[0].event < log.marks[1].event);
    CHECK(log.marks[1].event < log.marks[2].event);
    CHECK(log.events.at(log.marks[1].event).kind == StepEvent::Kind::compute);  // a mark starts a compute event
    const dist::StepTime t = dist::predict(log, dist::Machine{});
    // The compute row: one span per compute event, in order, never overlapping.
    double busy = 0, idle = 0, at = 0;
    for (const dist::StepSpan& s : t.compute_spans) {
      CHECK(log.events.at(s.event).kind == StepEvent::Kind::compute);
      CHECK(s.start >= at);
      CHECK(s.end >= s.start);
      busy += s.end - s.start, idle += s.start - at, at = s.end;
    }
    idle += t.step - at;
    CHECK(busy == doctest::Approx(t.compute));
    CHECK(idle == doctest::Approx(t.exposed));
    CHECK(t.exposed == doctest::Approx(t.step - t.compute));
    // The communication row: one span per collective, each after its link's previous one
    // and after the compute that came before its issue (a bucket's all-reduce after the
    // backward that produced its gradients); compute after a wait starts once it is done.
    std::map<int, double> link_free;
    std::map<int64_t, double> done;
    size_t compute_at = 0, reductions = 0, hidden = 0;
    double last_end = 0, compute_end = 0;
    for (const dist::StepSpan& s : t.collective_spans) {
      const StepEvent& e = log.events.at(s.event);
      REQUIRE(e.kind == StepEvent::Kind::issue);
      while (compute_at < t.compute_spans.size() && t.compute_spans[compute_at].event < s.event)
        compute_end = t.compute_spans[compute_at++].end;
      CHECK(s.start >= compute_end);
      CHECK(s.start >= link_free[e.group]);
      CHECK(s.end >= s.start);
      link_free[e.group] = s.end, done[e.collective] = s.end, last_end = std::max(last_end, s.end);
      const auto op = static_cast<dist::CollectiveOp>(e.op);
      if (op == (stage == 0 ? dist::CollectiveOp::all_reduce : dist::CollectiveOp::reduce_scatter) && e.sent > 1e6) {
        ++reductions;
        if (s.end <= t.compute_spans.back().end && s.event < log.marks[2].event) ++hidden;
      }
    }
    for (size_t i = 0, c = 0; i < log.events.size(); ++i) {
      while (c < t.compute_spans.size() && t.compute_spans[c].event < i) ++c;
      if (log.events[i].kind == StepEvent::Kind::wait && c < t.compute_spans.size())
        CHECK(t.compute_spans[c].start >= done.at(log.events[i].collective));
    }
    CHECK(t.step == doctest::Approx(std::max(t.compute_spans.back().end, last_end)));
    // Overlap happens: gradient reductions of the backward that end while compute goes on.
    CHECK(reductions >= 12);
    CHECK(hidden >= 1);
  }
}

}  // namespace zg::test
