#include "dist/comm/step_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "dist/comm/process_group.h"
#include "tensor/error.h"

namespace zg::dist {

std::string Machine::describe() const {
  char text[400];
  std::snprintf(text, sizeof text,
                "%.0f TFLOP/s, %.0f GB/s memory, %.1f us a kernel; %d ranks a node: %.0f GB/s + %.1f us within, "
                "%.0f GB/s + %.1f us across nodes",
                flops_per_second / 1e12, memory_bytes_per_second / 1e9, kernel_seconds * 1e6, ranks_per_node,
                intra_bytes_per_second / 1e9, intra_latency_seconds * 1e6, inter_bytes_per_second / 1e9,
                inter_latency_seconds * 1e6);
  return text;
}

std::string Machine::describe_offload() const {
  char text[160];
  std::snprintf(text, sizeof text, "offload: host %.0f GB/s, link %.0f GB/s, disk %.1f GB/s",
                host_bytes_per_second / 1e9, link_bytes_per_second / 1e9, disk_bytes_per_second / 1e9);
  return text;
}

namespace {

// The latencies a collective pays: a ring's N - 1 steps (an all-reduce: a reduce-scatter
// and an all-gather, twice that), or NCCL's log-depth algorithms' log2 N where fewer (its
// double binary tree for all-reduce, PAT for all-gather and reduce-scatter at scale). A
// message pays one, on its sender's side (an all-to-all: a message a peer).
double latency_steps(int op, int size) {
  const auto kind = static_cast<CollectiveOp>(op);
  if (kind == CollectiveOp::send || kind == CollectiveOp::recv) return kind == CollectiveOp::send ? 1 : 0;
  const double ring = size - 1, log_depth = std::ceil(std::log2(size));
  const double steps = std::min(ring, log_depth);
  return kind == CollectiveOp::all_reduce ? 2 * steps : steps;
}

// A group lies within a node when its ranks, `stride` apart, span fewer than a node's
// (groups placed as a DeviceMesh places them: blocks that do not straddle nodes).
bool within_node(const StepGroup& g, int ranks_per_node) {
  return static_cast<int64_t>(g.stride) * (g.size - 1) < ranks_per_node;
}

// Seconds a unit of work holds what runs it: kernels (a launch each, then FLOPs or bytes,
// whichever takes longer) or offload's bytes at the host's, the link's or the disk's rate,
// added to the step's totals of the latter.
double busy_seconds(const StepEvent& e, const Machine& m, StepTime& t) {
  if (e.kind == StepEvent::Kind::compute)
    return e.kernels * m.kernel_seconds + std::max(e.flops / m.flops_per_second, e.bytes / m.memory_bytes_per_second);
  ZG_CHECK(e.offload(), "step model: a host thread's task issued a collective "
           "or queued work of its own; only kernels and offload's work run there");
  const bool host = e.kind == StepEvent::Kind::host, link = e.kind == StepEvent::Kind::link;
  const double busy = e.bytes / (host ? m.host_bytes_per_second : link ? m.link_bytes_per_second
                                                                       : m.disk_bytes_per_second);
  (host ? t.host : link ? t.link : t.disk) += busy;
  return busy;
}

// Runs task k on the host thread from `start`, its events one after another; returns its end.
double run_task(const StepLog& log, int64_t k, double start, const Machine& m, StepTime& t) {
  const StepLog& task = *log.tasks.at(static_cast<size_t>(k));
  for (size_t i = 0; i < task.events.size(); ++i) {
    const double busy = busy_seconds(task.events[i], m, t);
    t.task_spans.push_back({start, start + busy, i, k});
    start += busy;
    t.worker += busy;
  }
  return start;
}

// The tasks queued after the log's last join (all of them if none): the next step's.
std::vector<bool> carried_tasks(const StepLog& log) {
  std::vector<bool> carried(log.tasks.size());
  for (const StepEvent& e : log.events)
    if (e.kind == StepEvent::Kind::join) std::fill(carried.begin(), carried.end(), false);
    else if (e.kind == StepEvent::Kind::queue) carried.at(static_cast<size_t>(e.task)) = true;
  return carried;
}

}  // namespace

StepTime predict(const StepLog& log, const Machine& m) {
  ZG_CHECK(m.flops_per_second > 0 && m.memory_bytes_per_second > 0 && m.intra_bytes_per_second > 0 &&
               m.inter_bytes_per_second > 0 && m.ranks_per_node >= 1 && m.kernel_seconds >= 0 &&
               m.intra_latency_seconds >= 0 && m.inter_latency_seconds >= 0 && m.host_bytes_per_second > 0 &&
               m.link_bytes_per_second > 0 && m.disk_bytes_per_second > 0,
           "step model: every rate must be positive and every latency >= 0 (", m.describe(), ")");
  StepTime t;
  double now = 0;                                   // the compute stream
  std::vector<double> link_free(log.groups.size());  // when each group's last collective ends
  std::vector<double> done;                         // per collective, when it ends
  double worker_free = 0;                           // the host thread
  const std::vector<bool> carried = carried_tasks(log);
  for (size_t k = 0; k < carried.size(); ++k)
    if (carried[k]) worker_free = run_task(log, static_cast<int64_t>(k), worker_free, m, t);
  for (size_t i = 0; i < log.events.size(); ++i) {
    const StepEvent& e = log.events[i];
    switch (e.kind) {
      case StepEvent::Kind::issue: {
        const StepGroup& g = log.groups.at(static_cast<size_t>(e.group));
        const bool intra = within_node(g, m.ranks_per_node);
        const double duration =
            g.size <= 1 ? 0
                        : latency_steps(e.op, g.size) * (intra ? m.intra_latency_seconds : m.inter_latency_seconds) +
                              e.sent / (intra ? m.intra_bytes_per_second : m.inter_bytes_per_second);
        double& free = link_free[static_cast<size_t>(e.group)];
        const double start = std::max(free, now);  // once issued, and once the link is free
        free = start + duration;
        t.collective_spans.push_back({start, free, i});
        done.resize(static_cast<size_t>(e.collective) + 1);
        done[static_cast<size_t>(e.collective)] = free;
        t.communication += duration;
        break;
      }
      case StepEvent::Kind::wait: now = std::max(now, done.at(static_cast<size_t>(e.collective))); break;
      case StepEvent::Kind::queue:
        if (!carried.at(static_cast<size_t>(e.task))) worker_free = run_task(log, e.task, std::max(now, worker_free), m, t);
        break;
      case StepEvent::Kind::join: now = std::max(now, worker_free); break;
      default: {  // kernels, or offload's work on this thread
        const double busy = busy_seconds(e, m, t);
        t.compute_spans.push_back({now, now + busy, i});
        now += busy;
        (e.kind == StepEvent::Kind::compute ? t.compute : t.offload_held) += busy;
      }
    }
  }
  t.step = std::max(now, worker_free);
  for (double free : link_free) t.step = std::max(t.step, free);
  t.exposed = std::max(0.0, t.step - t.compute - t.offload_held);  // (rounding aside, never negative)
  return t;
}

}  // namespace zg::dist
