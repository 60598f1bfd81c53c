// tensor/trace.h's ranges as NVTX ranges, installed when the library loads, as the
// backend registers itself (cuda/backend.cu). NVTX v3 is header-only, shipped with the
// CUDA toolkit.
#include <nvtx3/nvToolsExt.h>

#include "tensor/trace.h"

namespace zg::cuda {

namespace {

const TraceHooks kNvtx{[](const char* name) { nvtxRangePushA(name); }, [] { nvtxRangePop(); }};

[[maybe_unused]] const bool installed = [] {
  set_trace_hooks(&kNvtx);
  return true;
}();

}  // namespace

}  // namespace zg::cuda
