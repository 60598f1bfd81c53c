// The messages of a schedule, and when each rank posts them.
//
// A schedule (schedule.h) orders compute only; the messages follow from it. Here they
// are placed: before an action that needs a message from another rank, the rank posts
// that receive together with the sends it has pending, as one batch (Megatron's
// send_forward_recv_backward); a send with no receive right after it is posted at once.
// Each batch is waited for before the rank goes on. That is how NCCL runs them -- one
// stream per rank, a batch a group, a send done only once its receive is posted -- and
// the strictest way any process group can, so a plan that finishes under it finishes on
// every group. message_plan() walks the plan under it and refuses one that cannot finish.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "dist/pipeline/schedule.h"

namespace zg::dist {

// What crosses the boundary between `stage` and `stage + 1` for one micro-batch: the
// activation going up (stage's output), or its gradient coming back.
struct Message {
  int micro_batch = 0;
  int stage = 0;
  bool gradient = false;

  // Micro-batch 0's activation comes after a header with its dtype and shape; the other
  // micro-batches' have the same (the batch splits evenly), so they come without one.
  bool carries_header() const { return !gradient && micro_batch == 0; }
  int from() const { return gradient ? stage + 1 : stage; }
  int to() const { return gradient ? stage : stage + 1; }
  // Unique within a step of a pipeline of `stages` stages: the process group's tag.
  int64_t tag(int stages) const { return (static_cast<int64_t>(micro_batch) * stages + stage) * 2 + (gradient ? 1 : 0); }
  std::string str() const;  // "micro-batch 3's activation from stage 1 to 2"
  bool operator==(const Message&) const = default;
};

// One batch a rank posts and waits for: its pending sends, and the receive its next
// action needs (if any).
struct Exchange {
  std::vector<Message> sends;
  std::optional<Message> receive;
};

using PlanStep = std::variant<Action, Exchange>;

// Per rank, its actions with the exchanges between them. Messages between two chunks of
// one rank are no messages: the executor hands them over. A plan that cannot finish under
// the rules above is a zg::Error naming each stuck rank and the message it waits on.
std::vector<std::vector<PlanStep>> message_plan(const Schedule& schedule);

}  // namespace zg::dist
