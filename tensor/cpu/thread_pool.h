// The CPU backend's worker threads: parallel_for(n, grain, fn) splits [0, n) into blocks
// of `grain` elements that the calling thread and the pool's workers take in turn from
// one counter, so a core the system takes away for a while (a busy or virtualised
// machine) delays only the blocks it holds, not half the work. The workers live as long
// as the process; between calls they spin for 100 us, then sleep (no thread is started
// per call, and a burst of calls -- the optimizer's spans -- wakes nobody).
//
// One call at a time uses the pool: a call that finds it busy (ranks running as threads
// of one process, each stepping its optimizer) runs on its own thread -- those ranks
// already keep the cores busy. ZG_CPU_THREADS sets the threads (default: the cores).
#pragma once

#include <cstdint>
#include <functional>

namespace zg::cpu {

// fn(begin, end) over [0, n) in blocks of `grain`; returns when every block is done. An
// exception from fn is rethrown on the calling thread (the first; the rest are dropped).
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// The threads a parallel_for runs on when the pool is free: the caller and the workers.
int64_t pool_threads();

}  // namespace zg::cpu
