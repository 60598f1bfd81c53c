// Pipeline parallelism composed with data and tensor parallelism, for a GPT: every
// schedule against one rank, activation checkpointing and mixed precision, the zero-bubble
// schedules' refusal of ZeRO-3, and checkpoints that reshard across stages
// (tests/pipeline_training.h says how runs are made and compared).
#include "pipeline_training.h"

namespace zg::test {

using namespace pipeline_training;

TEST_CASE("GPT through every schedule at p in {2, 4}, m in {1, 4, 8}, alone, with dp = 2 (DDP, ZeRO-1; at m = 4 "
          "also ZeRO-2 and 3, the zero-bubble ones ZeRO-2) and with tp = 2: one rank's steps") {
  check_every_schedule(Arch::gpt, {{1, 0, 1}, {2, 0, 1}, {2, 1, 1}, {2, 2, 1}, {2, 3, 1}, {1, 1, 2}});
}

TEST_CASE("activation checkpointing, bf16 compute and a loss scaler compose with the pipeline") {
  // Recomputed blocks, every schedule's kind of backward: one rank's steps, exactly (f64).
  const Run want = one_rank(Arch::gpt);
  for (ScheduleKind kind : {ScheduleKind::one_f_one_b, ScheduleKind::zb_h1}) {
    INFO(std::string(dist::name(kind)) << " with activation checkpointing");
    check_same_steps(pipelined({Arch::gpt, kind, 2, 4, 1, 2, 1, 1, {.checkpointing = true}}), want);
  }
  // bf16 compute with a GradScaler at 2^10: the scaled backward, unscaled by the step, is
  // one rank's to bf16's rounding of sums taken in another order.
  const Run bf16 = one_rank(Arch::gpt, {}, {.scaled_bf16 = true});
  const Run piped = pipelined({Arch::gpt, ScheduleKind::one_f_one_b, 2, 4, 1, 2, 1, 1, {.scaled_bf16 = true}});
  REQUIRE(piped.losses.size() == bf16.losses.size());
  for (size_t step = 0; step < bf16.losses.size(); ++step) {
    CHECK(piped.losses[step] == doctest::Approx(bf16.losses[step]).epsilon(1e-2));
    CHECK(piped.norms[step] == doctest::Approx(bf16.norms[step]).epsilon(5e-2));
  }
  CHECK(std::fabs(bf16.losses.back() - want.losses.back()) < 0.05);  // (bf16 trains as f64 does)
}

TEST_CASE("ZeRO-2 and 3 reducing once a step (ZeroConfig::reduce_once): one rank's steps, one reduction, not m") {
  const Run want = one_rank(Arch::gpt);
  for (int stage : {2, 3})
    for (ScheduleKind kind : {ScheduleKind::one_f_one_b, ScheduleKind::interleaved, ScheduleKind::zb_h1}) {
      if (stage == 3 && kind == ScheduleKind::zb_h1) continue;  // refused (below)
      const int v = kind == ScheduleKind::interleaved ? 2 : 1;  // two chunks a rank, one reduction
      INFO(std::string(dist::name(kind)) << " ZeRO stage " << stage);
      const Run once = pipelined({Arch::gpt, kind, 2, 4, v, 2, stage, 1, {.reduce_once = true}});
      check_same_steps(once, want);
      // ZeRO-2's traffic a step: each of the v m backwards reduce-scatters every unit of the
      // rank (with zeros where it has no gradient), X bytes; reducing once, one of them. The
      // rest (the step's all-gather, the loss, the norm) does not depend on m.
      if (stage != 2) continue;
      const auto bytes = [&](int m, bool reduce_once) {
        return pipelined({Arch::gpt, kind, 2, m, v, 2, stage, 1, {.reduce_once = reduce_once}}).data_parallel_bytes;
      };
      const int64_t x = (bytes(4, false) - bytes(2, false)) / (2 * v * kSteps);
      CHECK(x > 0);
      CHECK(bytes(2, true) == once.data_parallel_bytes);
      CHECK(bytes(4, false) - once.data_parallel_bytes == (4 * v - 1) * x * kSteps);
    }
}

TEST_CASE("zero-bubble schedules refuse chunks whose ZeRO-3 frees the weights W reads") {
  CHECK_THROWS_WITH_AS(pipelined({Arch::gpt, ScheduleKind::zb_h1, 2, 4, 1, 2, 3}),
                       doctest::Contains("pipeline: zb-h1 runs each micro-batch's W after its I, and a ZeRO-3 "
                                         "ShardedModel frees a unit's gathered weights"),
                       Error);
}

TEST_CASE("a save at pp = 2 x dp = 2 resumes at pp = 4 and at one rank with an uninterrupted run's steps") {
  const std::string dir = "/tmp/zg_test_pipeline_save_" + std::to_string(::getpid());
  const Run whole = one_rank(Arch::gpt, {.first = 0, .last = 2 * kSteps});
  const Run first = pipelined({Arch::gpt, ScheduleKind::one_f_one_b, 2, 4, 1, 2, 1}, {.save = dir});
  check_same_steps(first, one_rank(Arch::gpt));
  const Span rest{.first = kSteps, .last = 2 * kSteps, .resume = dir};
  {
    INFO("resumed at pp = 4 (GPipe, ZeRO-3 over dp = 1)");
    check_same_steps(pipelined({Arch::gpt, ScheduleKind::gpipe, 4, 2, 1, 1, 3}, rest), whole, kSteps);
  }
  {
    INFO("resumed at one rank, the model whole");
    check_same_steps(one_rank(Arch::gpt, rest), whole, kSteps);
  }
  {
    INFO("resumed at pp = 2 x tp = 2 (interleaved)");
    check_same_steps(pipelined({Arch::gpt, ScheduleKind::interleaved, 2, 2, 2, 1, 1, 2}, rest), whole, kSteps);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace zg::test
