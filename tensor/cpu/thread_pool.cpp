#include "tensor/cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace zg::cpu {

namespace {

// How long a worker, or a caller waiting for the workers, spins before it sleeps: calls
// come in bursts (the optimizer's spans one after another), and waking a sleeping thread
// costs tens of microseconds on a virtual machine (OpenMP's threads spin likewise).
constexpr auto kSpin = std::chrono::microseconds(100);

// Spins until pred() or kSpin has passed; returns pred().
template <class P>
bool spin_until(const P& pred) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > until) return false;
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  return true;
}

// States: idle (generation_ unchanged, workers asleep) -> running (a call published its
// job and bumped generation_; workers and the caller take blocks) -> idle again once
// every worker has reported the generation done. Invariant: job_ is read only while
// its generation runs, and the caller waits for every worker before returning.
class Pool {
 public:
  explicit Pool(int threads) {
    for (int t = 1; t < threads; ++t) workers_.emplace_back([this] { work(); });
  }
  ~Pool() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : workers_) t.join();
  }

  bool busy_or_take() { return !in_use_.try_lock(); }  // true: someone else has the pool
  void give_back() { in_use_.unlock(); }
  size_t workers() const { return workers_.size(); }

  void run(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    {
      std::lock_guard lock(mutex_);
      fn_ = &fn, n_ = n, grain_ = grain, next_.store(0), error_ = nullptr, finished_.store(0);
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    take_blocks();
    spin_until([&] { return finished_.load() == workers_.size(); });
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return finished_.load() == workers_.size(); });
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  void take_blocks() {
    for (int64_t begin; (begin = next_.fetch_add(grain_)) < n_;) {
      try {
        (*fn_)(begin, std::min(n_, begin + grain_));
      } catch (...) {
        std::lock_guard lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }
  void work() {
    uint64_t seen = 0;
    for (;;) {
      spin_until([&] { return generation_.load() != seen; });
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_.load() != seen; });
        if (stopping_) return;
        seen = generation_.load();
      }
      take_blocks();
      {
        std::lock_guard lock(mutex_);
        finished_.fetch_add(1);
      }
      done_.notify_one();
    }
  }

  std::mutex in_use_;  // held by the one call using the pool
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, grain_ = 1;
  std::atomic<int64_t> next_{0};
  std::atomic<uint64_t> generation_{0};  // written under mutex_, also read spinning
  std::atomic<size_t> finished_{0};
  bool stopping_ = false;
  std::exception_ptr error_;
};

Pool& pool() {
  static Pool instance([] {
    const char* set = std::getenv("ZG_CPU_THREADS");
    const int threads = set ? std::atoi(set) : static_cast<int>(std::thread::hardware_concurrency());
    return std::max(1, threads);
  }());
  return instance;
}

}  // namespace

int64_t pool_threads() { return static_cast<int64_t>(pool().workers()) + 1; }

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  grain = std::max<int64_t>(grain, 1);
  Pool& p = pool();
  if (n <= grain || p.workers() == 0 || p.busy_or_take()) {  // one block, no helpers, or the pool is in use
    for (int64_t begin = 0; begin < n; begin += grain) fn(begin, std::min(n, begin + grain));
    return;
  }
  struct GiveBack {
    Pool& p;
    ~GiveBack() { p.give_back(); }
  } give_back{p};
  p.run(n, grain, fn);
}

}  // namespace zg::cpu
