// Pipeline schedules as data (dist/pipeline/schedule.h): each schedule's order, run on
// the idealised machine of simulate(), idles as its paper's formula says and holds the
// activations it says; malformed schedules are refused by name. The executor
// (dist/pipeline/pipeline.h) runs each over ranks as threads and gives one rank's gradients.
#include <chrono>
#include <map>
#include <mutex>

#include "dist/comm/fake_group.h"
#include "dist/comm/local_group.h"
#include "dist/pipeline/messages.h"
#include "dist/pipeline/pipeline.h"
#include "dist/pipeline/schedule.h"
#include "dist/pipeline/stages.h"
#include "dist/pipeline/step_time.h"
#include "tensor/step_log.h"
#include "tensor/context.h"
#include "helpers.h"

namespace zg::test {

using dist::Action;
using dist::ScheduleKind;

namespace {
// Idle time per rank, in units of a forward: the bubble fraction times the makespan.
double idle_per_rank(const dist::Timeline& t) { return t.bubble_fraction() * t.makespan; }
double formula_idle(const dist::Schedule& s, const dist::ActionTimes& times = {}) {
  const double f = dist::formula_bubble_fraction(s, times);
  return f / (1 - f) * s.micro_batches * s.chunks * (times.forward + times.backward_input + times.backward_weight);
}
}  // namespace

TEST_CASE("1F1B is the textbook order: p - 1 - r forwards ahead, then one forward one backward") {
  const dist::Schedule s = dist::make_schedule(ScheduleKind::one_f_one_b, 4, 8);
  CHECK(s.str() ==
        "rank 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7\n"
        "rank 1: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7\n"
        "rank 2: F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7\n"
        "rank 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7\n");
  // Interleaved: groups of p micro-batches through chunk 0, then chunk 1; backwards in reverse.
  const dist::Schedule v = dist::make_schedule(ScheduleKind::interleaved, 2, 4, 2);
  CHECK(v.str() ==
        "rank 0: F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3\n"
        "rank 1: F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3\n");
  // ZB-H1: 1F1B's warm-up; rank r defers its first r weight gradients.
  const dist::Schedule zb = dist::make_schedule(ScheduleKind::zb_h1, 2, 4);
  CHECK(zb.str() == "rank 0: F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3\n"
                    "rank 1: F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3\n");
}

TEST_CASE("every schedule at p in {2, 4}, m in {1, 4, 8}: the simulated bubble equals its formula") {
  for (ScheduleKind kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved,
                            ScheduleKind::zb_h1, ScheduleKind::zb_h2})
    for (int p : {2, 4})
      for (int m : {1, 4, 8}) {
        const bool interleaved = kind == ScheduleKind::interleaved;
        if (interleaved && m % p != 0) continue;
        // The zero-bubble formulas need the pipeline full (m >= p; ZB-H2's warm-up, m >= 2p).
        if ((kind == ScheduleKind::zb_h1 && m < p) || (kind == ScheduleKind::zb_h2 && m < 2 * p)) continue;
        const dist::Schedule s = dist::make_schedule(kind, p, m, interleaved ? 2 : 1);
        INFO(std::string(dist::name(kind)) << " p=" << p << " m=" << m << "\n" << s.str());
        const dist::Timeline t = dist::simulate(s);
        CHECK(idle_per_rank(t) == doctest::Approx(formula_idle(s)).epsilon(1e-12));
        CHECK(t.bubble_fraction() == doctest::Approx(dist::formula_bubble_fraction(s)).epsilon(1e-12));
      }
  // GPipe and 1F1B in closed form: (p - 1) / (m + p - 1); interleaving divides the idle time by v.
  CHECK(dist::simulate(dist::make_schedule(ScheduleKind::one_f_one_b, 4, 8)).bubble_fraction() ==
        doctest::Approx(3.0 / 11));
  CHECK(dist::simulate(dist::make_schedule(ScheduleKind::interleaved, 4, 8, 2)).bubble_fraction() ==
        doctest::Approx(3.0 / 19));
  // ZB-H1 idles a third of 1F1B at F = I = W.
  CHECK(idle_per_rank(dist::simulate(dist::make_schedule(ScheduleKind::zb_h1, 4, 8))) ==
        doctest::Approx(idle_per_rank(dist::simulate(dist::make_schedule(ScheduleKind::one_f_one_b, 4, 8))) / 3));
}

TEST_CASE("ZB-H1 follows its formula at other action times; the last stage's ramp bounds every schedule") {
  for (const dist::ActionTimes times : {dist::ActionTimes{1, 1, 0.5}, dist::ActionTimes{1, 1.5, 0.5},
                                        dist::ActionTimes{2, 1, 1}})
    for (ScheduleKind kind : {ScheduleKind::one_f_one_b, ScheduleKind::zb_h1}) {
      const dist::Schedule s = dist::make_schedule(kind, 4, 16);
      INFO(std::string(dist::name(kind)) << " F=" << times.forward << " I=" << times.backward_input << " W=" << times.backward_weight);
      CHECK(idle_per_rank(dist::simulate(s, times)) == doctest::Approx(formula_idle(s, times)));
      CHECK(idle_per_rank(dist::simulate(s, times)) >= 3 * times.forward - 1e-12);
    }
}

TEST_CASE("activations held: GPipe all m, 1F1B p - r, ZB-H1 p on every rank, ZB-H2 about twice that") {
  const auto peaks = [](ScheduleKind kind, int chunks = 1) {
    return dist::simulate(dist::make_schedule(kind, 4, 8, chunks)).peak_activations();
  };
  CHECK(peaks(ScheduleKind::gpipe) == std::vector<int>{8, 8, 8, 8});
  CHECK(peaks(ScheduleKind::one_f_one_b) == std::vector<int>{4, 3, 2, 1});
  CHECK(peaks(ScheduleKind::zb_h1) == std::vector<int>{4, 4, 4, 4});
  CHECK(peaks(ScheduleKind::zb_h2) == std::vector<int>{8, 7, 6, 5});
  // Interleaved counts chunks: the first rank holds 11 (micro-batch, chunk) pairs, each half a stage's.
  CHECK(peaks(ScheduleKind::interleaved, 2) == std::vector<int>{11, 9, 7, 5});
}

TEST_CASE("malformed schedules and arguments are refused, naming what is wrong") {
  CHECK_THROWS_WITH_AS(dist::parse_schedule("1F1B"),
                       "pipeline: unknown schedule '1F1B'; the schedules are gpipe, 1f1b, interleaved, zb-h1, zb-h2",
                       Error);
  CHECK(dist::parse_schedule("zb-h2") == ScheduleKind::zb_h2);
  CHECK_THROWS_WITH_AS(dist::make_schedule(ScheduleKind::interleaved, 4, 6, 2),
                       "pipeline: interleaved runs the micro-batches in groups of the 4 ranks; 6 micro-batches are "
                       "not a multiple of 4",
                       Error);
  CHECK_THROWS_WITH_AS(dist::make_schedule(ScheduleKind::interleaved, 4, 8, 1),
                       doctest::Contains("interleaved needs at least 2 chunks"), Error);
  CHECK_THROWS_WITH_AS(dist::make_schedule(ScheduleKind::gpipe, 4, 8, 2),
                       doctest::Contains("gpipe runs one chunk a rank, got 2"), Error);
  CHECK_THROWS_WITH_AS(dist::make_schedule(ScheduleKind::one_f_one_b, 0, 8), doctest::Contains("at least one rank"),
                       Error);
  // Hand-made orders: a backward before its forward can never run; a missing action is named.
  dist::Schedule s = dist::make_schedule(ScheduleKind::one_f_one_b, 2, 2);
  std::swap(s.actions[1][0], s.actions[1][1]);  // rank 1: B0 F0 ...
  CHECK_THROWS_WITH_AS(dist::simulate(s),
                       "pipeline: the 1f1b schedule cannot finish: each rank waits for an action that comes after its "
                       "own (rank 0 at B0, rank 1 at B0)",
                       Error);
  s = dist::make_schedule(ScheduleKind::one_f_one_b, 2, 2);
  s.actions[0].pop_back();
  CHECK_THROWS_WITH_AS(dist::simulate(s), "pipeline: rank 0 never runs B1 (stage 0)", Error);
  s = dist::make_schedule(ScheduleKind::one_f_one_b, 2, 2);
  s.actions[0].push_back({Action::forward, 0, 0});
  CHECK_THROWS_WITH_AS(dist::simulate(s), "pipeline: rank 0 runs F0 twice", Error);
  s = dist::make_schedule(ScheduleKind::zb_h1, 2, 2);
  s.actions[0][1] = {Action::backward, 0, 0};
  CHECK_THROWS_WITH_AS(dist::simulate(s), doctest::Contains("is a whole backward in a schedule that splits it"), Error);
}

namespace {
// A rank's plan as text: actions, and exchanges in brackets ("sa3" sends micro-batch 3's
// activation, "rg0" receives micro-batch 0's gradient).
std::string plan_str(const std::vector<dist::PlanStep>& steps) {
  std::string out;
  const auto message = [](const char* dir, const dist::Message& m) {
    return dir + std::string(m.gradient ? "g" : "a") + std::to_string(m.micro_batch);
  };
  for (const dist::PlanStep& step : steps) {
    out += out.empty() ? "" : " ";
    if (const auto* a = std::get_if<Action>(&step)) {
      out += a->str();
      continue;
    }
    const auto& e = std::get<dist::Exchange>(step);
    std::string batch;
    for (const dist::Message& m : e.sends) batch += (batch.empty() ? "" : " ") + message("s", m);
    if (e.receive) batch += (batch.empty() ? "" : " ") + message("r", *e.receive);
    out += "[" + batch + "]";
  }
  return out;
}
}  // namespace

TEST_CASE("messages: a send goes with the next receive in one batch, and every schedule's plan finishes under NCCL's "
          "rule (a send waits for its receive)") {
  // 1F1B: Megatron's send_forward_recv_backward -- the output goes with the next gradient's receive.
  const auto plan = dist::message_plan(dist::make_schedule(ScheduleKind::one_f_one_b, 2, 4));
  CHECK(plan_str(plan[0]) == "F0 [sa0] F1 [sa1 rg0] B0 F2 [sa2 rg1] B1 F3 [sa3 rg2] B2 [rg3] B3");
  CHECK(plan_str(plan[1]) == "[ra0] F0 B0 [sg0 ra1] F1 B1 [sg1 ra2] F2 B2 [sg2 ra3] F3 B3 [sg3]");
  // Where two ranks would each wait at a send for a receive the other posts later (ZB-H2's
  // and interleaving's crossings), a send waits for the rank's next batch.
  for (ScheduleKind kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved,
                            ScheduleKind::zb_h1, ScheduleKind::zb_h2})
    for (int p = 2; p <= 8; ++p)
      for (int m = 1; m <= 24; ++m)
        for (int v : {1, 2, 3}) {
          if ((kind == ScheduleKind::interleaved) != (v > 1) || (kind == ScheduleKind::interleaved && m % p != 0)) continue;
          INFO(dist::name(kind) << " p=" << p << " m=" << m << " v=" << v);
          CHECK_NOTHROW(dist::message_plan(dist::make_schedule(kind, p, m, v)));
        }
  // A rank that takes its inputs in another order than its peer sends them is refused up front.
  dist::Schedule s = dist::make_schedule(ScheduleKind::gpipe, 2, 2);
  std::swap(s.actions[1][0], s.actions[1][1]);  // rank 1: F1 F0 B0 B1
  CHECK_THROWS_WITH_AS(dist::message_plan(s),
                       "pipeline: in a gpipe pipeline of 2 ranks x 1 chunk, 2 micro-batches, rank 0 sends rank 1 "
                       "micro-batch 0's activation from stage 0 to 1 where that rank receives micro-batch 1's "
                       "activation from stage 0 to 1: the two orders differ",
                       Error);
}

namespace {

constexpr int kLayers = 8, kWidth = 6, kRows = 8;

// Eight Linear + GELU layers in f64: every rank makes all of them alike (one seed) and
// keeps its stages' layers.
std::vector<std::shared_ptr<nn::Module>> make_layers() {
  manual_seed(7);
  std::vector<std::shared_ptr<nn::Module>> layers;
  for (int l = 0; l < kLayers; ++l)
    layers.push_back(std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
        std::make_shared<nn::Linear>(kWidth, kWidth, true, std::nullopt, TensorOptions(DType::f64)),
        std::make_shared<nn::GELU>()}));
  return layers;
}
Tensor batch_inputs() { return arange(0, kRows * kWidth, 1, DType::f64).view({kRows, kWidth}) / 40.0 - 0.5; }
Tensor batch_targets() { return sin(arange(0, kRows * kWidth, 1, DType::f64).view({kRows, kWidth}) / 7.0); }
Tensor mean_squared_error(const Tensor& output, const Tensor& target) { return mse_loss(output, target); }

// One rank's loss and each layer's weight gradient over the whole batch.
std::pair<double, std::vector<Tensor>> one_rank() {
  const auto layers = make_layers();
  Tensor x = batch_inputs();
  for (const auto& layer : layers) x = (*layer)(x);
  const Tensor loss = mean_squared_error(x, batch_targets());
  loss.backward();
  std::vector<Tensor> grads;
  for (const auto& layer : layers) grads.push_back(layer->parameters().front().grad().clone());
  return {loss.item<double>(), grads};
}

// Stage s of S holds layers [s L / S, (s + 1) L / S) as one Sequential chunk.
std::vector<std::shared_ptr<nn::Module>> chunks_of(const std::vector<std::shared_ptr<nn::Module>>& layers,
                                                   const dist::Schedule& s, int rank) {
  std::vector<std::shared_ptr<nn::Module>> chunks;
  const int per_stage = kLayers / s.stages();
  for (int c = 0; c < s.chunks; ++c) {
    auto chunk = std::make_shared<nn::Sequential>();
    for (int l = 0; l < per_stage; ++l) chunk->push_back(layers[s.stage(rank, c) * per_stage + l]);
    chunks.push_back(chunk);
  }
  return chunks;
}

}  // namespace

TEST_CASE("the executor runs every schedule at p in {2, 4}, m in {1, 4, 8}: one rank's loss and gradients") {
  const auto [loss, grads] = one_rank();
  for (ScheduleKind kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved,
                            ScheduleKind::zb_h1, ScheduleKind::zb_h2})
    for (int p : {2, 4})
      for (int m : {1, 4, 8}) {
        const int v = kind == ScheduleKind::interleaved ? 2 : 1;
        if (m % p != 0 && v > 1) continue;
        INFO(std::string(dist::name(kind)) << " p=" << p << " m=" << m);
        std::mutex mutex;
        std::vector<double> losses(p);
        std::vector<Tensor> got(kLayers);
        dist::run_local(p, [&, kind, m, v](dist::ProcessGroup& pp) {
          const auto layers = make_layers();
          const dist::Schedule s = dist::make_schedule(kind, pp.size(), m, v);
          dist::Pipeline pipeline(pp, s, chunks_of(layers, s, pp.rank()), mean_squared_error);
          const double mine = pipeline.run(batch_inputs(), batch_targets());
          std::lock_guard lock(mutex);
          losses[pp.rank()] = mine;
          for (int l = 0; l < kLayers; ++l)
            if (s.rank_of(l / (kLayers / s.stages())) == pp.rank()) got[l] = layers[l]->parameters().front().grad();
        });
        for (int r = 0; r < p; ++r) CHECK(losses[r] == doctest::Approx(loss).epsilon(1e-12));
        for (int l = 0; l < kLayers; ++l) {
          INFO("layer " << l);
          REQUIRE(got[l].defined());
          CHECK(max_abs_diff(got[l], grads[l]) < 1e-12);
        }
      }
}

TEST_CASE("a stage whose micro-batches give outputs of different shapes is refused, naming both") {
  // Only micro-batch 0's activation brings a header (messages.h); the rest must match it.
  struct Ragged : nn::Module {
    int calls = 0;
    Tensor forward(const Tensor& x) override { return calls++ == 0 ? x : x.narrow(1, 0, 2); }
  };
  CHECK_THROWS_WITH_AS(dist::run_local(2,
                                       [](dist::ProcessGroup& pp) {
                                         const dist::Schedule s = dist::make_schedule(ScheduleKind::gpipe, 2, 2);
                                         std::vector<std::shared_ptr<nn::Module>> chunks{std::make_shared<Ragged>()};
                                         dist::Pipeline(pp, s, chunks, mean_squared_error)
                                             .run(batch_inputs(), batch_targets());
                                       }),
                       doctest::Contains("pipeline: stage 0's output for micro-batch 1 is f64[4, 2] on cpu, "
                                         "micro-batch 0's was f64[4, 6]; every micro-batch must give a stage's "
                                         "output one shape and dtype"),
                       Error);
}

TEST_CASE("ranks that run different schedules, or a schedule for another group, are refused on every rank") {
  CHECK_THROWS_WITH_AS(dist::run_local(2,
                                       [](dist::ProcessGroup& pp) {
                                         const auto layers = make_layers();
                                         const dist::Schedule s = dist::make_schedule(ScheduleKind::one_f_one_b, 2,
                                                                                      pp.rank() == 0 ? 4 : 8);
                                         dist::Pipeline(pp, s, chunks_of(layers, s, pp.rank()), mean_squared_error);
                                       }),
                       doctest::Contains("pipeline: a different number of micro-batches on some ranks (from 4 to 8)"),
                       Error);
  dist::run_local(2, [](dist::ProcessGroup& pp) {
    const auto layers = make_layers();
    const dist::Schedule s = dist::make_schedule(ScheduleKind::one_f_one_b, 4, 4);
    CHECK_THROWS_WITH_AS(dist::Pipeline(pp, s, chunks_of(layers, s, 0), mean_squared_error),
                         "pipeline: the 1f1b schedule is for 4 ranks, the group has 2", Error);
    const dist::Schedule ok = dist::make_schedule(ScheduleKind::gpipe, 2, 3);
    dist::Pipeline pipeline(pp, ok, chunks_of(layers, ok, pp.rank()), mean_squared_error);
    CHECK_THROWS_WITH_AS(pipeline.run(batch_inputs(), batch_targets()),
                         doctest::Contains("do not split into 3 micro-batches along dim 0"), Error);
  });
}

namespace {
nn::GPTConfig four_layer_gpt() {
  nn::GPTConfig c;
  c.n_layer = 4, c.n_head = 2, c.n_embd = 16, c.vocab_size = 32, c.block_size = 16;
  return c;
}
Tensor gpt_tokens(int64_t seed) {
  manual_seed(seed);
  return (rand({4, 16}, DType::f64) * 32.0).to(DType::i64);
}
}  // namespace

TEST_CASE("GPT cut into stages (the tied embedding summed between the ends) trains as one rank: its gradients") {
  manual_seed(3);
  nn::GPT reference(four_layer_gpt(), TensorOptions(DType::f64));
  const Tensor idx = gpt_tokens(11), targets = gpt_tokens(12);
  const Tensor loss = reference.forward(idx, targets).loss;
  loss.backward();
  std::map<std::string, Tensor> want;
  for (const auto& [name, t] : reference.named_parameters()) want[name] = t.grad();
  struct Layout {
    ScheduleKind kind;
    int p, m, v;
  };
  for (const Layout layout : {Layout{ScheduleKind::one_f_one_b, 2, 4, 1}, Layout{ScheduleKind::one_f_one_b, 4, 4, 1},
                              Layout{ScheduleKind::gpipe, 4, 2, 1}, Layout{ScheduleKind::interleaved, 2, 2, 2}}) {
    INFO(std::string(dist::name(layout.kind)) << " p=" << layout.p << " m=" << layout.m << " v=" << layout.v);
    std::mutex mutex;
    std::map<std::string, int> compared;  // per parameter: the ranks that held it
    std::vector<double> losses(layout.p);
    dist::run_local(layout.p, [&](dist::ProcessGroup& pp) {
      manual_seed(3);
      nn::GPT model(four_layer_gpt(), TensorOptions(DType::f64));
      const dist::Schedule s = dist::make_schedule(layout.kind, pp.size(), layout.m, layout.v);
      const dist::Stages stages = dist::gpt_stages(model, s.stages());
      std::vector<std::shared_ptr<nn::Module>> mine;
      for (int c = 0; c < s.chunks; ++c) mine.push_back(stages.modules[s.stage(pp.rank(), c)]);
      dist::Pipeline pipeline(pp, s, mine, stages.loss, stages.tied);
      const double got = pipeline.run(gpt_tokens(11), gpt_tokens(12));
      std::lock_guard lock(mutex);
      losses[pp.rank()] = got;
      for (const auto& [name, t] : model.named_parameters()) {
        if (!t.grad().defined()) continue;
        const std::string parameter = name;  // INFO's lambda cannot capture a structured binding (Clang)
        INFO(parameter << " on rank " << pp.rank());
        CHECK(max_abs_diff(t.grad(), want.at(parameter)) < 1e-12);
        ++compared[parameter];
      }
    });
    for (double l : losses) CHECK(l == doctest::Approx(loss.item<double>()).epsilon(1e-12));
    for (const auto& [name, grad] : want) {
      const std::string parameter = name;
      INFO(parameter);
      CHECK(compared[parameter] == (parameter == "transformer.wte.weight" ? 2 : 1));  // wte: both ends
    }
  }
  CHECK_THROWS_WITH_AS(dist::gpt_stages(reference, 5), "gpt_stages: 5 stages for a model of 4 layers; each stage needs at "
                       "least one block", Error);
}

namespace {
// Rank r's activation peak over a dry run of `kind` at p = 4 and m micro-batches of 2 rows:
// a GPT on the meta device (shapes and bytes, no values), one block a stage.
// Rank `rank`'s activation peak over one step of a GPT (hidden states [2, 16, 32]) cut in 4
// stages, on the meta device: the four ranks as threads (headers sent), or with `alone`
// that rank by itself over a fake group, told the activations' shape (set_activation).
int64_t activation_peak(ScheduleKind kind, int m, int rank, bool alone = false) {
  int64_t peak = -1;
  const auto run = [&](dist::ProcessGroup& pp) {
    nn::GPTConfig config = four_layer_gpt();
    config.n_embd = 32;
    nn::GPT model(config, TensorOptions(DType::f32).device(kMeta));
    const dist::Schedule s = dist::make_schedule(kind, 4, m);
    const dist::Stages stages = dist::gpt_stages(model, 4);
    dist::Pipeline pipeline(pp, s, stages.chunks(s, pp.rank()), stages.loss, stages.tied);
    if (alone) pipeline.set_activation({2, 16, 32}, DType::f32);
    const Tensor tokens = zeros({2 * m, 16}, TensorOptions(DType::i64).device(kMeta));
    Context::current().allocator(kMeta)->reset_peaks();
    {
      MemoryScope scope(MemoryCategory::activation);
      const double loss = pipeline.run(tokens, tokens);
      CHECK((alone || std::isnan(loss)));  // a fake group's broadcast brings no other rank's loss
    }
    if (pp.rank() == rank) peak = memory_stats(kMeta).peak_of(MemoryCategory::activation);
  };
  if (!alone) {
    dist::run_local(4, run);
  } else {
    Context dry(rank);
    ContextGuard guard(dry);
    dist::FakeGroup pp(rank, 4);
    run(pp);
  }
  return peak;
}
}  // namespace

TEST_CASE("a dry run at p = 4, m = 8 on the meta device: each rank's activation peak holds the micro-batches the "
          "timeline says") {
  for (int rank : {0, 3}) {
    INFO("rank " << rank);
    // One rank alone over a fake group (bench/zero_memory --pp) holds what it holds among its peers.
    CHECK(activation_peak(ScheduleKind::one_f_one_b, 8, rank, true) == activation_peak(ScheduleKind::one_f_one_b, 8, rank));
    // One micro-batch's activations, held from its F to its B: a GPipe run at m = 2 peaks
    // that much above one at m = 1. The zero-bubble schedules hold them from F to W.
    const int64_t one = activation_peak(ScheduleKind::gpipe, 1, rank);
    const int64_t held = activation_peak(ScheduleKind::gpipe, 2, rank) - one;
    REQUIRE(held > 0);
    for (ScheduleKind kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::zb_h1, ScheduleKind::zb_h2}) {
      const int in_flight = dist::simulate(dist::make_schedule(kind, 4, 8)).peak_activations()[rank];
      INFO(std::string(dist::name(kind)) << ": " << in_flight << " micro-batches in flight");
      const int64_t peak = activation_peak(kind, 8, rank), formula = one + (in_flight - 1) * held;
      if (!dist::splits_backward(kind)) {
        CHECK(peak == formula);
      } else {  // a micro-batch between its I and its W has freed what I alone needed
        CHECK(peak <= formula);
        CHECK(peak > formula - held);
      }
    }
  }
}

}  // namespace zg::test

namespace zg::test {

TEST_CASE("the step-time model of a pipeline rank: its replayed actions, and the schedule's idle time at their mean") {
  // Rank 0 of a GPT in 4 stages, alone over a fake group on the meta device, its step recorded.
  const auto predict = [](ScheduleKind kind) {
    Context dry(0);
    ContextGuard guard(dry);
    dist::FakeGroup pp(0, 4);
    nn::GPTConfig config = four_layer_gpt();
    config.n_embd = 32;
    nn::GPT model(config, TensorOptions(DType::f32).device(kMeta));
    const dist::Schedule s = dist::make_schedule(kind, 4, 8);
    const dist::Stages stages = dist::gpt_stages(model, 4);
    dist::Pipeline pipeline(pp, s, stages.chunks(s, 0), stages.loss, stages.tied);
    pipeline.set_activation({2, 16, 32}, DType::f32);
    const Tensor tokens = zeros({16, 16}, TensorOptions(DType::i64).device(kMeta));
    StepLog log;
    {
      StepLogScope recording(log);
      pipeline.run(tokens, tokens);
    }
    const dist::StepTime replay = dist::predict(log, dist::Machine{});
    return std::pair{replay, dist::predict_pipeline(log, replay, s, 0)};
  };
  const auto [replay, one_f_one_b] = predict(ScheduleKind::one_f_one_b);
  CHECK(one_f_one_b.action.forward > 0);
  CHECK(one_f_one_b.action.backward_input + one_f_one_b.action.backward_weight > one_f_one_b.action.forward);
  CHECK(one_f_one_b.step == replay.step + one_f_one_b.idle);
  // Every stage as long as this one: 1F1B idles (p - 1) / (m + p - 1) of the step.
  CHECK(one_f_one_b.idle / (one_f_one_b.idle + one_f_one_b.busy) == doctest::Approx(3.0 / 11).epsilon(1e-12));
  const auto [zb_replay, zb_h1] = predict(ScheduleKind::zb_h1);
  CHECK(zb_h1.idle < one_f_one_b.idle);  // W fills the bubble
  CHECK(zb_h1.idle > 0);
  // A log the pipeline did not record is refused by name.
  CHECK_THROWS_WITH_AS(dist::predict_pipeline(StepLog{}, replay, dist::make_schedule(ScheduleKind::gpipe, 4, 8), 0),
                       doctest::Contains("the log has no action's mark"), Error);
}

}  // namespace zg::test
