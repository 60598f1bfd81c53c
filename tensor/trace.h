// Named ranges on a profiler's timeline. In a CUDA build each range is an NVTX
// push/pop, so Nsight Systems (nsys profile --trace=cuda,nvtx) shows the model above
// the kernels it issued: a module's forward ("attn (CausalSelfAttention)"), each
// op's backward ("backward: matmul"), the optimizer step, every collective. Without
// CUDA, or when no profiler is attached, a range costs next to nothing (NVTX's calls
// return at once until a tool injects itself).
#pragma once

#include <string>

namespace zg {

class TraceRange {
 public:
  explicit TraceRange(const char* name);
  explicit TraceRange(const std::string& name) : TraceRange(name.c_str()) {}
  ~TraceRange();
  TraceRange(const TraceRange&) = delete;
  TraceRange& operator=(const TraceRange&) = delete;
};

}  // namespace zg
