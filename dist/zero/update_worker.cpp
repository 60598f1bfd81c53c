#include "dist/zero/update_worker.h"

#include <utility>

#include "tensor/step_log.h"
#include "tensor/trace.h"

namespace zg::dist {

UpdateWorker::UpdateWorker(Context& context) : thread_([this, &context] { run(context); }) {}

UpdateWorker::~UpdateWorker() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void UpdateWorker::submit(std::function<void()> job) {
  if (StepLog* log = StepLog::current())  // a dry run: the job's work is a task of the step's log
    job = [task = log->queue(), job = std::move(job)] {
      StepLogScope recording(*task);
      job();
    };
  {
    std::lock_guard lock(mutex_);
    jobs_.push_back(std::move(job));
  }
  changed_.notify_all();
}

void UpdateWorker::drain() {
  if (StepLog* log = StepLog::current()) log->join();
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return jobs_.empty() && running_ == 0; });
  if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
}

void UpdateWorker::run(Context& context) {
  ContextGuard guard(context);
  set_trace_thread_name("optimizer");
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
    if (jobs_.empty()) return;
    std::function<void()> job = std::move(jobs_.front());
    jobs_.pop_front();
    ++running_;
    lock.unlock();
    std::exception_ptr failed;
    try {
      job();
    } catch (...) {
      failed = std::current_exception();
    }
    lock.lock();
    --running_;
    if (failed && !failure_) failure_ = failed;
    changed_.notify_all();
  }
}

}  // namespace zg::dist
