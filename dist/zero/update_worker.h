// A host thread that runs jobs in the order they are given: each unit's CPU AdamW, started
// as the unit's gradient lands while the backward goes on (ShardedModel::step_in_backward).
// Jobs run under the rank's context (the host pool counts what they allocate) on a timeline
// row named "optimizer". In a dry run (a StepLog recording the submitting thread) each job is
// a task of the log, recorded on this thread, and drain() a join: the step model's host thread.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "tensor/context.h"

namespace zg::dist {

class UpdateWorker {
 public:
  explicit UpdateWorker(Context& context);
  ~UpdateWorker();  // runs what is queued, then stops
  UpdateWorker(const UpdateWorker&) = delete;
  UpdateWorker& operator=(const UpdateWorker&) = delete;

  void submit(std::function<void()> job);
  void drain();  // waits for every job queued; rethrows the first one's failure

 private:
  void run(Context& context);

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> jobs_;
  int running_ = 0;
  bool stopping_ = false;
  std::exception_ptr failure_;
  std::thread thread_;  // last: started once the rest exists
};

}  // namespace zg::dist
