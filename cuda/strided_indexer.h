// The strided indexer that lets one CUDA kernel read any view: element i of a flat
// (row-major) walk over a shape, and where it lies in each operand, whatever their
// strides (broadcast dims have stride 0). Plain C++ -- kernels call offsets() on the
// device, and the CPU tests check it against a direct computation.
//
// Shapes and strides travel to a kernel by value in this struct. Before launch, dims of
// size 1 are dropped and dims that are contiguous in every operand are merged, so a
// contiguous tensor becomes rank 1 and a typical view rank 2-3. Finding a dim's index
// takes a division by its size per element; below 2^31 elements (every GPT-sized
// activation) that is FastDivider's multiply and shift in 32 bits, else a 64-bit
// division, a subroutine of some 70 instructions on a GPU.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <vector>

#include "tensor/error.h"
#include "tensor/int_math.h"
#include "tensor/shape.h"

namespace zg::cuda {

inline constexpr int kMaxRank = 10;

template <int N>
struct StridedIndexer {
  int rank = 0;
  bool small = true;  // fewer than 2^31 elements: 32-bit index arithmetic
  int64_t shape[kMaxRank] = {};
  FastDivider size[kMaxRank] = {};  // shape[d], for `small`
  int64_t strides[N][kMaxRank] = {};

  // Element offsets of flat (row-major) position i in each of the N operands: its index
  // in dim d is i's d-th digit in the mixed radix of the shape, the last dim's fastest.
  // (The first dim's digit is what is left: i < numel, so no division is needed there.)
  ZG_HOST_DEVICE void offsets(int64_t i, int64_t (&out)[N]) const {
    for (int j = 0; j < N; ++j) out[j] = 0;
    if (rank == 0) return;
    if (small) {
      uint32_t rest = static_cast<uint32_t>(i);
      for (int d = rank - 1; d > 0; --d) {
        const uint32_t next = size[d].div(rest);
        const int64_t index = rest - next * size[d].divisor;
        rest = next;
        for (int j = 0; j < N; ++j) out[j] += index * strides[j][d];
      }
      for (int j = 0; j < N; ++j) out[j] += static_cast<int64_t>(rest) * strides[j][0];
      return;
    }
    for (int d = rank - 1; d > 0; --d) {
      const int64_t index = i % shape[d];
      i /= shape[d];
      for (int j = 0; j < N; ++j) out[j] += index * strides[j][d];
    }
    for (int j = 0; j < N; ++j) out[j] += i * strides[j][0];
  }
};

// The indexer for `shape` with one stride list per operand (each the same rank as shape).
template <int N>
StridedIndexer<N> make_indexer(const Shape& shape, const std::array<const Shape*, N>& strides, const char* op) {
  // Keep the dims of size != 1, then merge d into d+1 where every operand steps
  // over d exactly as far as one full run of d+1.
  std::vector<int64_t> dims;
  std::array<std::vector<int64_t>, N> st;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    const bool mergeable = !dims.empty() && [&] {
      for (int j = 0; j < N; ++j)
        if (st[j].back() != (*strides[j])[d] * shape[d]) return false;
      return true;
    }();
    if (mergeable) {
      dims.back() *= shape[d];
      for (int j = 0; j < N; ++j) st[j].back() = (*strides[j])[d];
    } else {
      dims.push_back(shape[d]);
      for (int j = 0; j < N; ++j) st[j].push_back((*strides[j])[d]);
    }
  }
  ZG_CHECK(static_cast<int>(dims.size()) <= kMaxRank, op, ": the CUDA backend handles views of at most ", kMaxRank,
           " non-mergeable dims, got shape ", shape_str(shape), " (make the tensor contiguous first)");
  StridedIndexer<N> ix;
  ix.rank = static_cast<int>(dims.size());
  int64_t elements = 1;
  for (int d = 0; d < ix.rank; ++d) {
    ix.shape[d] = dims[d];
    elements = dims[d] > 0 && elements > std::numeric_limits<int32_t>::max() / dims[d]
                   ? int64_t{std::numeric_limits<int32_t>::max()} + 1
                   : elements * dims[d];
    for (int j = 0; j < N; ++j) ix.strides[j][d] = st[j][d];
  }
  ix.small = elements <= std::numeric_limits<int32_t>::max();
  if (ix.small && elements > 0)  // (no element, no division: a dim may then be 2^32 or more)
    for (int d = 0; d < ix.rank; ++d) ix.size[d] = FastDivider(static_cast<uint32_t>(dims[d]));
  return ix;
}

}  // namespace zg::cuda
