// Named ranges on a profiler's timeline: a module's forward ("attn (CausalSelfAttention)"),
// each op's backward ("backward: matmul"), the optimizer step, every collective. The
// ranges go to a recording memory timeline (memory_timeline.h), where they name the
// phase of each allocation, and to whatever range calls a backend installed: the CUDA backend installs
// NVTX's (cuda/nvtx.cpp), so Nsight Systems (nsys profile --trace=cuda,nvtx) shows the
// model above the kernels it issued. With none installed, or when no profiler is
// attached, a range costs next to nothing (NVTX's calls return at once until a tool
// injects itself).
#pragma once

#include <string>

#include "tensor/memory_timeline.h"

namespace zg {

// A profiler's range calls: push opens a named range on the calling thread, pop closes
// the innermost one.
struct TraceHooks {
  void (*push)(const char* name);
  void (*pop)();
};

// Installs the calls of the ranges opened from now on (nullptr: none). A backend installs
// its own while the library loads; `hooks` lives as long as the library.
void set_trace_hooks(const TraceHooks* hooks);

// Names the calling thread's row on the timeline ("communication": a process group's
// worker); rows of threads that name none are their rank's "compute".
void set_trace_thread_name(const std::string& name);

class TraceRange {
 public:
  // `scope`: on a recording timeline, opened under the path it was recorded on elsewhere
  // (an autograd node's backward, under its forward's).
  explicit TraceRange(const char* name, TracePath scope = {});
  explicit TraceRange(const std::string& name, TracePath scope = {}) : TraceRange(name.c_str(), scope) {}
  ~TraceRange();
  TraceRange(const TraceRange&) = delete;
  TraceRange& operator=(const TraceRange&) = delete;

 private:
  const TraceHooks* hooks_;  // the calls that opened the range close it
  uint64_t timeline_ = 0;    // the recording it was noted in (0: none)
};

}  // namespace zg
