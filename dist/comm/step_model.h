// A step-time model: replays what a dry run did (tensor/step_log.h: the exact kernels
// and collectives the code issues, recorded on the meta device with a fake group) on a
// machine described by a few rates, to predict the step time of N ranks without them.
//
//   compute stream  kernels in order; each costs a launch, then its FLOPs at the
//                   achieved rate or its bytes at memory bandwidth, whichever is longer
//   a link per group  its collectives in issue order (NCCL: a stream per communicator),
//                   each starting once issued and once the one before it is done:
//                   latency steps (a ring's N - 1, or log2 N where NCCL has a log-depth
//                   algorithm) x latency + the bytes this rank sends (ring-counted) /
//                   bandwidth -- within a node when the group's ranks share one, else across
//   a wait          holds the compute stream until its collective is done (as NCCL's
//                   wait makes the compute stream wait)
//   offload's work  the CPU AdamW (its bytes at the host's rate), copies over the host link,
//                   the file tier's reads and writes (the disk's rate): each holds the
//                   compute stream where the code does it on the training thread
//   the host thread its tasks (what UpdateWorker ran: a unit's CPU AdamW queued during the
//                   backward, the delayed update) in queue order, each starting once queued
//                   and once the one before it is done, its work one event after another; a
//                   join holds the compute stream until every task queued so far is done.
//                   A task queued after the step's last join is the next step's: its copy
//                   queued by the step before runs from the step's start (the steady state)
//
// Step time = when the last of them ends; exposed = step time - the compute stream's busy time.
// Left out: groups sharing one physical link at once, both threads copying in one direction
// of the host link at once (each is charged the whole rate; the two directions are apart),
// the network's topology beyond "within or across nodes", kernels slowed by concurrent
// communication.
#pragma once

#include <string>
#include <vector>

#include "tensor/step_log.h"

namespace zg::dist {

struct Machine {
  double flops_per_second = 400e12;         // achieved on the model's matrix products (H100 bf16: ~40% of 989e12)
  double memory_bytes_per_second = 2.5e12;  // achieved by the elementwise kernels (H100 HBM3: 3.35e12 peak)
  double kernel_seconds = 4e-6;             // a kernel's launch and tail
  int ranks_per_node = 8;
  double intra_bytes_per_second = 360e9, intra_latency_seconds = 3e-6;  // NVLink 4, one direction, achieved
  double inter_bytes_per_second = 45e9, inter_latency_seconds = 12e-6;  // 400 Gb/s InfiniBand per GPU
  // Offload: the CPU AdamW's bytes (read and written) a second (the H100 box's 16-core Xeon at
  // 100M parameters: bench/results/h100-2026-11-26), the host link's (PCIe 5 x16, achieved, one
  // direction, through a staging buffer), and the file tier's disk (one PCIe 4 NVMe drive).
  double host_bytes_per_second = 140e9, link_bytes_per_second = 25e9, disk_bytes_per_second = 6e9;
  std::string describe() const;          // the rates, in the units people quote them
  std::string describe_offload() const;  // offload's: "offload: host 140 GB/s, link 25 GB/s, disk 6.0 GB/s"
};

// When one event of the log ran, in seconds from the step's start: a compute event's
// kernels on the compute stream, or a collective on its group's link (`event`: its issue),
// or a task's work on the host thread (`event` an index into that task's events).
struct StepSpan {
  double start = 0, end = 0;
  size_t event = 0;  // an index into StepLog::events (or StepLog::tasks[task]->events)
  int64_t task = -1;
};

struct StepTime {
  double step = 0;           // seconds
  double compute = 0;        // the compute stream's busy time
  double communication = 0;  // the collectives' durations, summed over groups
  double exposed = 0;        // step - compute - offload_held: what the compute stream's work did not hide
  double host = 0, link = 0, disk = 0;  // offload's: the CPU's, the host link's, the disk's seconds
  double offload_held = 0;   // offload's seconds on the compute stream (the rest ran on the host thread)
  double worker = 0;         // the host thread's busy seconds
  double offload() const { return host + link + disk; }
  // The schedule, in log order: what a Gantt chart draws (step_figure.h). The compute
  // stream is idle between its spans (a wait) and after the last (the links still busy);
  // offload's work on the training thread is among its spans, the host thread's in task_spans.
  std::vector<StepSpan> compute_spans, collective_spans, task_spans;
};

// Replays `log` on `machine`. A task is written by the host thread while it runs: predict
// once the thread is done with the log's tasks (a delayed update's lands at the next step(),
// save() or load(), or with its ShardedModel).
StepTime predict(const StepLog& log, const Machine& machine);

}  // namespace zg::dist
