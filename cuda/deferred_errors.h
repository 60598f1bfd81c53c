// Errors that a kernel finds: an index outside its range (embedding's token ids,
// cross_entropy's targets), which the CPU backend reports by throwing.
//
// A kernel cannot throw, and checking each result on the host would need one
// host synchronisation per op, which the hot path must not have. So a kernel
// that meets a bad index writes a harmless value (a zero row, a NaN loss),
// records the index in this thread's error record -- a few bytes of pinned host
// memory that the device writes into directly -- and carries on. The host looks
// at the record whenever it synchronises with the stream anyway (every copy to
// the host: item(), to_vector(), .to(kCPU)) and throws the zg::Error there, so a
// training loop that reads its loss reports a bad token at the step that used it.
// Ranks are threads, so "this thread's record" is this rank's.
#pragma once

#include <cstdint>

#include "tensor/device.h"

namespace zg::cuda {

enum class DeferredErrorKind : int32_t {
  none = 0,
  embedding_index = 1,
  embedding_backward_index = 2,
  cross_entropy_target = 3,
  cross_entropy_backward_target = 4,  // changed since the forward checked it (written through a raw pointer)
  quantize_non_finite = 5,            // value: the element's index, bound: the tensor's elements
};

// Written by kernels with plain stores (several threads may race; any of them is a
// correct report): kind last, after a system-wide fence.
struct DeferredError {
  int64_t value;  // the bad index
  int64_t bound;  // the valid range is [0, bound)
  int32_t kind;   // DeferredErrorKind; none while no error was recorded
  int32_t padding;
};

// This thread's record for `device`, as a pointer kernels on that device can write.
DeferredError* deferred_error_record(Device device);

// Throws the recorded error (and clears it) if a kernel recorded one. Call only once
// the stream's work up to now has finished (after a stream synchronisation).
void raise_deferred_errors(Device device);

}  // namespace zg::cuda

#if defined(__CUDACC__)
namespace zg::cuda {
__device__ __forceinline__ void record_deferred_error(DeferredError* record, DeferredErrorKind kind, int64_t value,
                                                      int64_t bound) {
  volatile DeferredError* r = record;
  r->value = value;
  r->bound = bound;
  __threadfence_system();
  r->kind = static_cast<int32_t>(kind);
  __threadfence_system();
}
}  // namespace zg::cuda
#endif
