// simulate(): a schedule run on an idealised machine, and what its timeline shows.
#include <algorithm>
#include <cmath>

#include "dist/pipeline/schedule.h"
#include "tensor/tensor.h"

namespace zg::dist {

namespace {

constexpr double kNotYet = -1;

// When each action of every (micro-batch, stage) ends, as the simulation finds out.
struct Ends {
  Ends(int stages, int m) : forward(stages, std::vector<double>(m, kNotYet)), input_grad(forward), weight(forward) {}
  std::vector<std::vector<double>> forward, input_grad, weight;  // input_grad: B or I
  std::vector<std::vector<double>>& of(Action::Kind kind) {
    return kind == Action::forward ? forward : kind == Action::backward_weight ? weight : input_grad;
  }
};

// Every (micro-batch, stage) once forward and once backward (B, or I and W), each on the
// rank that holds the stage; anything else names the first action that breaks it.
void check_coverage(const Schedule& s) {
  ZG_CHECK(static_cast<int>(s.actions.size()) == s.ranks, "pipeline: the schedule lists ", s.actions.size(),
           " ranks' actions for ", s.ranks, " ranks");
  std::vector<std::vector<int>> seen(4 * s.stages(), std::vector<int>(s.micro_batches, 0));
  for (int r = 0; r < s.ranks; ++r)
    for (const Action& a : s.actions[r]) {
      ZG_CHECK(a.micro_batch >= 0 && a.micro_batch < s.micro_batches && a.chunk >= 0 && a.chunk < s.chunks,
               "pipeline: rank ", r, "'s action ", a.str(), " is outside the schedule's ", s.micro_batches,
               " micro-batches and ", s.chunks, " chunks");
      const bool half = a.kind == Action::backward_input || a.kind == Action::backward_weight;
      ZG_CHECK(!(s.splits_backward() && a.kind == Action::backward), "pipeline: rank ", r, "'s action ", a.str(),
               " is a whole backward in a schedule that splits it into I and W");
      ZG_CHECK(s.splits_backward() || !half, "pipeline: rank ", r, "'s action ", a.str(),
               " splits a backward the schedule runs whole");
      ZG_CHECK(++seen[a.kind * s.stages() + s.stage(r, a.chunk)][a.micro_batch] == 1, "pipeline: rank ", r, " runs ",
               a.str(), " twice");
    }
  for (int k = 0; k < 4; ++k)
    for (int stage = 0; stage < s.stages(); ++stage)
      for (int i = 0; i < s.micro_batches; ++i) {
        const auto kind = static_cast<Action::Kind>(k);
        const bool needed = kind == Action::forward || (kind == Action::backward) != s.splits_backward();
        ZG_CHECK(!needed || seen[k * s.stages() + stage][i] == 1, "pipeline: rank ", s.rank_of(stage), " never runs ",
                 Action{kind, i, s.chunk_of(stage)}.str(), " (stage ", stage, ")");
      }
}

}  // namespace

// Each rank runs its actions in order; an action starts once its rank is free and its
// input is there: F after the previous stage's F, B or I after the next stage's (the last
// stage's after its own F), W after its I. Ranks are advanced in turn until all are done;
// a pass that advances none is a deadlock.
Timeline simulate(const Schedule& s, const ActionTimes& times) {
  check_coverage(s);
  const int last = s.stages() - 1;
  Ends ends(s.stages(), s.micro_batches);
  Timeline timeline;
  timeline.ranks.resize(s.ranks);
  std::vector<double> free_at(s.ranks, 0);
  std::vector<size_t> next(s.ranks, 0);
  const auto ready_at = [&](int r, const Action& a) -> double {
    const int stage = s.stage(r, a.chunk), i = a.micro_batch;
    const auto after = [&](double end, int from_stage) {
      return end == kNotYet ? kNotYet : end + (s.rank_of(from_stage) == r ? 0 : times.send);
    };
    switch (a.kind) {
      case Action::forward: return stage == 0 ? 0 : after(ends.forward[stage - 1][i], stage - 1);
      case Action::backward:
      case Action::backward_input:
        return stage == last ? ends.forward[stage][i] : after(ends.input_grad[stage + 1][i], stage + 1);
      case Action::backward_weight: return ends.input_grad[stage][i];
    }
    return kNotYet;
  };
  const auto duration = [&](Action::Kind kind) {
    return kind == Action::forward          ? times.forward
           : kind == Action::backward       ? times.backward_input + times.backward_weight
           : kind == Action::backward_input ? times.backward_input
                                            : times.backward_weight;
  };
  for (bool advanced = true; advanced;) {
    advanced = false;
    for (int r = 0; r < s.ranks; ++r)
      while (next[r] < s.actions[r].size()) {
        const Action& a = s.actions[r][next[r]];
        const double ready = ready_at(r, a);
        if (ready == kNotYet) break;
        const double start = std::max(free_at[r], ready), end = start + duration(a.kind);
        ends.of(a.kind)[s.stage(r, a.chunk)][a.micro_batch] = free_at[r] = end;
        timeline.ranks[r].push_back({a, start, end});
        timeline.makespan = std::max(timeline.makespan, end);
        ++next[r], advanced = true;
      }
  }
  std::string stuck;
  for (int r = 0; r < s.ranks; ++r)
    if (next[r] < s.actions[r].size())
      stuck += (stuck.empty() ? "" : ", ") + ("rank " + std::to_string(r) + " at " + s.actions[r][next[r]].str());
  ZG_CHECK(stuck.empty(), "pipeline: the ", name(s.kind), " schedule cannot finish: each rank waits for an action that "
           "comes after its own (", stuck, ")");
  return timeline;
}

double Timeline::bubble_fraction() const {
  double busy = 0;
  for (const auto& rank : ranks)
    for (const Block& b : rank) busy += b.end - b.start;
  const double capacity = static_cast<double>(ranks.size()) * makespan;
  return capacity > 0 ? (capacity - busy) / capacity : 0;
}

std::vector<int> Timeline::peak_activations() const {
  std::vector<int> peaks;
  for (const auto& rank : ranks) {
    const bool split = std::any_of(rank.begin(), rank.end(), [](const Block& b) {
      return b.action.kind == Action::backward_weight;
    });
    const Action::Kind frees = split ? Action::backward_weight : Action::backward;
    int held = 0, peak = 0;
    for (const Block& b : rank) {
      held += b.action.kind == Action::forward ? 1 : b.action.kind == frees ? -1 : 0;
      peak = std::max(peak, held);
    }
    peaks.push_back(peak);
  }
  return peaks;
}

// Idle time per rank over the step: (p - 1) times what a micro-batch's trip through the
// pipeline leaves unfilled (schedule.h), against the rank's work m v (F + I + W). No
// schedule idles less than (p - 1) F in a step that starts together on every rank: the
// last stage's first input needs that long to arrive.
double formula_bubble_fraction(const Schedule& s, const ActionTimes& t) {
  const double p = s.ranks, work = s.micro_batches * s.chunks * (t.forward + t.backward_input + t.backward_weight);
  double idle = (p - 1) * (t.forward + t.backward_input + t.backward_weight);
  if (s.kind == ScheduleKind::zb_h1) idle = (p - 1) * std::max(t.forward, t.forward + t.backward_input - t.backward_weight);
  if (s.kind == ScheduleKind::zb_h2)
    idle = (p - 1) * std::max(t.forward, t.forward + t.backward_input - 2 * t.backward_weight);
  return idle / (work + idle);
}

}  // namespace zg::dist
