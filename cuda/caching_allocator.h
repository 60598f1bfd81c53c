// The CUDA caching allocator (one per rank context and GPU): see the
// implementation for its pools, block states and invariants.
#pragma once

#include <cuda_runtime.h>

#include <memory>

#include "tensor/memory.h"
#include "tensor/tensor.h"

namespace zg::cuda {

// The allocator the CUDA backend gives each rank context for `device`.
std::shared_ptr<Allocator> make_caching_allocator(Device device);

// `tensor`'s memory is also used by work on `stream` (e.g. a collective on the
// communication stream): when it is freed, its block is reused only after that
// work has finished.
void record_stream(const Tensor& tensor, cudaStream_t stream);

}  // namespace zg::cuda
