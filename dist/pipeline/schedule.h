// A pipeline schedule as data: for each rank of the pipeline, the order in which it runs
// its compute actions. One executor runs every schedule (dist/pipeline/pipeline.h); the
// messages between stages follow from the actions, so a schedule is only this order.
//
// The model is cut into p x v stages; rank r holds v of them ("chunks", virtual stages
// for interleaving): chunk c of rank r is stage c p + r, so a micro-batch visits the
// ranks round-robin v times. Actions on (micro-batch i, chunk c):
//   F  the forward; sends its output to the next stage
//   B  the whole backward: input and weight gradients; sends the input gradient back
//   I  the input gradient alone -- what the previous stage waits for (zero bubble)
//   W  the weight gradient alone -- nobody waits for it, so it fills the bubbles
// A micro-batch's activations live on a stage from its F to its B (or its W).
//
// The bubble -- the share of a step a rank idles -- with F, I, W a chunk's times, B = I + W,
// for m >= p micro-batches (ZB-H2: m >= 2p, its warm-up):
//   GPipe, 1F1B    (p - 1) / (m + p - 1)                     1F1B holds p micro-batches, not m
//   interleaved    (p - 1) / (v m + p - 1)                   the idle time shrinks v times
//   ZB-H1          idle (p - 1)(F + I - W) of a step         a third of 1F1B's at F = I = W
//   ZB-H2          idle (p - 1)(F + I - 2 W), at least       holds about 2p
//                  (p - 1) F
// (Huang et al. 2019; Narayanan et al. 2021; Qi et al. 2023.) No schedule idles less than
// (p - 1) F in a step every rank starts together (the last stage's first input takes that
// long to come): the paper's zero for ZB-H2 also needs its optimizer step without that
// synchronisation. The zero-bubble orders are built for F = I = W. simulate() measures them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace zg::dist {

enum class ScheduleKind : uint8_t { gpipe, one_f_one_b, interleaved, zb_h1, zb_h2 };
const char* name(ScheduleKind kind);         // "gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"
ScheduleKind parse_schedule(std::string_view text);  // a name above, else zg::Error listing them
// The zero-bubble schedules: B split into I and W.
inline bool splits_backward(ScheduleKind kind) { return kind == ScheduleKind::zb_h1 || kind == ScheduleKind::zb_h2; }

struct Action {
  enum Kind : uint8_t { forward, backward, backward_input, backward_weight } kind = forward;
  int micro_batch = 0;
  int chunk = 0;
  std::string str() const;  // "F3", "B3", "I3", "W3"; with a chunk past 0, "F3.1"
  bool operator==(const Action&) const = default;
};

struct Schedule {
  ScheduleKind kind = ScheduleKind::one_f_one_b;
  int ranks = 1;          // p
  int chunks = 1;         // v, stages per rank
  int micro_batches = 1;  // m
  std::vector<std::vector<Action>> actions;  // per rank, in the order it runs them

  int stages() const { return ranks * chunks; }
  int stage(int rank, int chunk) const { return chunk * ranks + rank; }
  int rank_of(int stage) const { return stage % ranks; }
  int chunk_of(int stage) const { return stage / ranks; }
  bool splits_backward() const { return dist::splits_backward(kind); }
  std::string str() const;  // one line per rank: "rank 0: F0 F1 B0 ..."
  std::string describe() const;  // "a 1f1b pipeline of 4 ranks x 1 chunk, 8 micro-batches"
};

// The schedule of `kind` for p ranks and m micro-batches; `chunks` (v) > 1 for
// interleaved only, which needs m a multiple of p (Megatron's rule: the micro-batches go
// round in groups of p).
Schedule make_schedule(ScheduleKind kind, int ranks, int micro_batches, int chunks = 1);

// Action times for simulate(); B = I + W. The defaults are the usual rule of thumb: a
// backward costs twice a forward, its halves alike.
struct ActionTimes {
  double forward = 1, backward_input = 1, backward_weight = 1;
  double send = 0;  // a message's latency between ranks
  // A chunk's times when a rank's stage is cut into `chunks` (interleaving): each 1/v.
  ActionTimes per_chunk(int chunks) const {
    return {forward / chunks, backward_input / chunks, backward_weight / chunks, send};
  }
};

// A schedule run on an idealised machine: every action as long as `times` says, each
// waiting for its rank and for its input (the previous stage's F, the next stage's B or
// I). A schedule that can never finish (an action waiting for one that comes after it) is
// a zg::Error naming the ranks' next actions.
struct Timeline {
  struct Block {
    Action action;
    double start = 0, end = 0;
  };
  std::vector<std::vector<Block>> ranks;  // per rank, in run order
  double makespan = 0;                    // when the last action ends
  // idle / (ranks x makespan): the share of the step the ranks spend waiting.
  double bubble_fraction() const;
  // Per rank: the most micro-batch chunks whose activations it holds at once (F run, its
  // B -- or W -- not yet).
  std::vector<int> peak_activations() const;
};
Timeline simulate(const Schedule& schedule, const ActionTimes& times = {});

// The bubble fraction of the formulas above for `schedule` at `times`.
double formula_bubble_fraction(const Schedule& schedule, const ActionTimes& times = {});

}  // namespace zg::dist
