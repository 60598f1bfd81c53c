#include "tensor/trace.h"

#ifdef ZG_WITH_NVTX
#include <nvtx3/nvToolsExt.h>  // header-only NVTX v3, shipped with the CUDA toolkit
#endif

namespace zg {

#ifdef ZG_WITH_NVTX
TraceRange::TraceRange(const char* name) { nvtxRangePushA(name); }
TraceRange::~TraceRange() { nvtxRangePop(); }
#else
TraceRange::TraceRange(const char*) {}
TraceRange::~TraceRange() = default;
#endif

}  // namespace zg
