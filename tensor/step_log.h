// What a dry run did, in order: the record a step-time model replays (dist/comm/step_model.h).
// While a StepLogScope lives on a thread, the meta backend notes each kernel's work
// (FLOPs of its matrix products, bytes it reads and writes) and the fake group each
// collective it issues (the bytes this rank sends, ring-counted) and each wait for one.
// The dry run computes nothing, so the log says what a real run would do, not how long
// it takes: the model supplies the rates. Offload's work is noted apart: kernels on the
// host pool's tensors (the CPU AdamW), copies between it and the device (the host link),
// and the file tier's reads and writes (the disk). Work handed to a host thread (the CPU
// AdamW queued by ShardedModel::step_in_backward or the delayed update) is a task: its own
// log, queued at a point of this one and joined where the thread is waited for.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace zg {

struct StepEvent {
  // host, link, disk: offload's work; queue: a task handed to the host thread; join: this
  // thread waits until every task queued so far is done.
  enum class Kind : uint8_t { compute, issue, wait, host, link, disk, queue, join };
  Kind kind = Kind::compute;
  double flops = 0, bytes = 0;  // compute, host, link, disk: the work (merged while nothing else comes between)
  int kernels = 0;              // compute: how many kernels (each pays a launch)
  int64_t collective = -1;      // issue, wait: which one, numbered in issue order
  int op = 0;                   // issue: the dist::CollectiveOp
  int group = -1;               // issue: which group, an index into StepLog::groups
  double sent = 0;              // issue: bytes this rank sends (ring-counted)
  int64_t task = -1;            // queue: which one, an index into StepLog::tasks
  bool offload() const { return kind == Kind::host || kind == Kind::link || kind == Kind::disk; }
};

// A group as the model places it: `size` ranks, consecutive ones `stride` apart (1: a
// block of ranks; a hybrid mesh's replica group: the shard group size).
struct StepGroup {
  const void* identity = nullptr;
  int size = 1, stride = 1;
};

// Where a phase of the step begins ("forward", "backward", "optimizer"): at events[event].
// For drawing the step (dist/comm/step_figure.h); the model ignores marks.
struct StepMark {
  std::string name;
  size_t event = 0;
};

class StepLog {
 public:
  std::vector<StepEvent> events;
  std::vector<StepGroup> groups;
  std::vector<StepMark> marks;
  std::vector<std::shared_ptr<StepLog>> tasks;  // each written by the host thread that runs it

  void compute(double flops, double bytes);  // a kernel: merged into the last event unless a mark or collective came between
  void offload(StepEvent::Kind kind, double bytes);  // host, link or disk work, merged alike
  void mark(std::string phase);
  int64_t issue(int op, double sent, const void* group, int size, int stride);  // returns its number
  void wait(int64_t collective);
  std::shared_ptr<StepLog> queue();  // a task's log, to record it into on the thread that runs it
  void join();
  void clear();
  // The log recording on this thread, or null.
  static StepLog* current();

 private:
  int64_t issued_ = 0;
};

// Records this thread's kernels and collectives into `log` while it lives.
class StepLogScope {
 public:
  explicit StepLogScope(StepLog& log);
  ~StepLogScope();
  StepLogScope(const StepLogScope&) = delete;
  StepLogScope& operator=(const StepLogScope&) = delete;

 private:
  StepLog* previous_;
};

}  // namespace zg
