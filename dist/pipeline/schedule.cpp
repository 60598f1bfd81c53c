#include "dist/pipeline/schedule.h"

#include <algorithm>

#include "tensor/tensor.h"

namespace zg::dist {

const char* name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::gpipe: return "gpipe";
    case ScheduleKind::one_f_one_b: return "1f1b";
    case ScheduleKind::interleaved: return "interleaved";
    case ScheduleKind::zb_h1: return "zb-h1";
    case ScheduleKind::zb_h2: return "zb-h2";
  }
  return "?";
}

std::string Schedule::describe() const {
  return std::string(kind == ScheduleKind::interleaved ? "an " : "a ") + name(kind) + " pipeline of " + std::to_string(ranks) + " ranks x " +
         std::to_string(chunks) + (chunks == 1 ? " chunk, " : " chunks, ") + std::to_string(micro_batches) +
         (micro_batches == 1 ? " micro-batch" : " micro-batches");
}

ScheduleKind parse_schedule(std::string_view text) {
  for (ScheduleKind k : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved,
                         ScheduleKind::zb_h1, ScheduleKind::zb_h2})
    if (text == name(k)) return k;
  fail("pipeline: unknown schedule '", text, "'; the schedules are gpipe, 1f1b, interleaved, zb-h1, zb-h2");
}

std::string Action::str() const {
  static constexpr char kLetters[] = {'F', 'B', 'I', 'W'};
  return kLetters[kind] + std::to_string(micro_batch) + (chunk > 0 ? "." + std::to_string(chunk) : "");
}

std::string Schedule::str() const {
  std::string text;
  for (int r = 0; r < ranks; ++r) {
    text += "rank " + std::to_string(r) + ":";
    for (const Action& a : actions[r]) text += " " + a.str();
    text += "\n";
  }
  return text;
}

namespace {

// All forwards, then all backwards (torch.distributed.pipelining's ScheduleGPipe).
std::vector<Action> gpipe(int m) {
  std::vector<Action> order;
  for (int i = 0; i < m; ++i) order.push_back({Action::forward, i, 0});
  for (int i = 0; i < m; ++i) order.push_back({Action::backward, i, 0});
  return order;
}

// Rank r runs p - 1 - r forwards ahead (warm-up), then one forward one backward, then
// the remaining backwards (cool-down): it holds at most p - r micro-batches.
std::vector<Action> one_f_one_b(int p, int m, int r) {
  const int warmup = std::min(p - 1 - r, m);
  std::vector<Action> order;
  for (int i = 0; i < warmup; ++i) order.push_back({Action::forward, i, 0});
  for (int i = 0; i < m - warmup; ++i) {
    order.push_back({Action::forward, warmup + i, 0});
    order.push_back({Action::backward, i, 0});
  }
  for (int i = m - warmup; i < m; ++i) order.push_back({Action::backward, i, 0});
  return order;
}

// Megatron's interleaved 1F1B: the k-th forward of a rank is micro-batch
// (k / (p v)) p + k % p on chunk (k / p) % v -- groups of p micro-batches go through one
// chunk, then the next --; backwards go through the chunks in reverse. Warm-up:
// 2 (p - 1 - r) + (v - 1) p forwards.
std::vector<Action> interleaved(int p, int m, int v, int r) {
  const int total = m * v;
  const auto at = [&](Action::Kind kind, int k) {
    const int chunk = (k / p) % v;
    return Action{kind, (k / (p * v)) * p + k % p, kind == Action::forward ? chunk : v - 1 - chunk};
  };
  const int warmup = std::min(2 * (p - 1 - r) + (v - 1) * p, total);
  std::vector<Action> order;
  for (int k = 0; k < warmup; ++k) order.push_back(at(Action::forward, k));
  for (int k = 0; k < total - warmup; ++k) {
    order.push_back(at(Action::forward, warmup + k));
    order.push_back(at(Action::backward, k));
  }
  for (int k = total - warmup; k < total; ++k) order.push_back(at(Action::backward, k));
  return order;
}

// The zero-bubble orders (Qi et al. 2023) on rank r: `warmup` forwards, then `deferred`
// pairs F I whose W waits, then F I W until the forwards are done, then I W, then the
// deferred W's. ZB-H1: 1F1B's warm-up, p - 1 - r, and r deferred W's: every rank holds p
// micro-batches, 1F1B's peak. ZB-H2: the warm-up grows to fill the time until the first
// input gradient comes back, 2 (p - 1 - r) + 1 forwards, holding about twice as many.
std::vector<Action> zero_bubble(int m, int warmup, int deferred) {
  std::vector<Action> order;
  int f = 0, i = 0, w = 0;
  const auto run = [&](Action::Kind kind, int& next) { order.push_back({kind, next++, 0}); };
  while (f < std::min(warmup, m)) run(Action::forward, f);
  for (int k = 0; k < deferred && f < m; ++k) run(Action::forward, f), run(Action::backward_input, i);
  while (f < m) run(Action::forward, f), run(Action::backward_input, i), run(Action::backward_weight, w);
  while (i < m) run(Action::backward_input, i), run(Action::backward_weight, w);
  while (w < m) run(Action::backward_weight, w);
  return order;
}

}  // namespace

Schedule make_schedule(ScheduleKind kind, int ranks, int micro_batches, int chunks) {
  const int p = ranks, m = micro_batches, v = chunks;
  ZG_CHECK(p >= 1 && m >= 1, "pipeline: ", name(kind), " needs at least one rank and one micro-batch, got ", p,
           " ranks and ", m, " micro-batches");
  if (kind == ScheduleKind::interleaved) {
    ZG_CHECK(v >= 2, "pipeline: interleaved needs at least 2 chunks (virtual stages) a rank, got ", v,
             "; with one it is 1f1b");
    ZG_CHECK(m % p == 0, "pipeline: interleaved runs the micro-batches in groups of the ", p, " ranks; ", m,
             " micro-batches are not a multiple of ", p);
  } else {
    ZG_CHECK(v == 1, "pipeline: ", name(kind), " runs one chunk a rank, got ", v, "; interleaved runs several");
  }
  Schedule s{kind, p, v, m, {}};
  switch (kind) {
    case ScheduleKind::gpipe: s.actions.assign(p, gpipe(m)); break;
    case ScheduleKind::one_f_one_b:
      for (int r = 0; r < p; ++r) s.actions.push_back(one_f_one_b(p, m, r));
      break;
    case ScheduleKind::interleaved:
      for (int r = 0; r < p; ++r) s.actions.push_back(interleaved(p, m, v, r));
      break;
    case ScheduleKind::zb_h1:
      for (int r = 0; r < p; ++r) s.actions.push_back(zero_bubble(m, p - 1 - r, r));
      break;
    case ScheduleKind::zb_h2:
      for (int r = 0; r < p; ++r) s.actions.push_back(zero_bubble(m, 2 * (p - 1 - r) + 1, r));
      break;
  }
  return s;
}

}  // namespace zg::dist
