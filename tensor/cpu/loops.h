// The CPU backend's one loop: visit every element of a shape in row-major
// order, tracking the element offset of each operand from its own strides.
// Broadcast operands (stride 0) and transposed views need no special case.
#pragma once

#include <algorithm>
#include <array>
#include <vector>

#include "tensor/dtype.h"
#include "tensor/error.h"
#include "tensor/int_math.h"
#include "tensor/shape.h"
#include "tensor/cpu/thread_pool.h"

namespace zg::cpu {

// Elements a block of the element loops hands to one thread: large enough that the
// hand-off costs nothing next to it, small enough that a 2-core machine shares a tensor of
// a few hundred KiB.
constexpr int64_t kElementGrain = int64_t{1} << 15;

// Rows a block of the row loops hands to one thread: about kElementGrain elements.
inline int64_t row_grain(int64_t length) { return std::max<int64_t>(1, kElementGrain / std::max<int64_t>(1, length)); }

// f(offsets) for each element; offsets[j] indexes operand j. For maps only -- each element
// written depends on its own inputs alone: blocks of elements run on the backend's worker
// threads (tensor/cpu/thread_pool.h), so f is called concurrently for different elements.
template <size_t N, class F>
void for_each_element(const Shape& shape, const std::array<const Shape*, N>& strides, F&& f) {
  const int64_t rank = static_cast<int64_t>(shape.size());
  const int64_t count = numel(shape);
  if (count == 0) return;
  if (rank == 0) {
    f(std::array<int64_t, N>{});
    return;
  }
  // Fast path: every operand contiguous, so all offsets are the flat index.
  const Shape contiguous = contiguous_strides(shape);
  if (std::all_of(strides.begin(), strides.end(), [&](const Shape* s) { return *s == contiguous; })) {
    parallel_for(count, kElementGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        std::array<int64_t, N> offsets;
        offsets.fill(i);
        f(offsets);
      }
    });
    return;
  }
  // Rows of the innermost dimension, in blocks: each block finds its first row's offsets,
  // then walks an odometer over the outer dimensions.
  const int64_t inner = shape[rank - 1], rows = count / inner;
  std::array<int64_t, N> inner_stride;
  for (size_t j = 0; j < N; ++j) inner_stride[j] = (*strides[j])[rank - 1];
  parallel_for(rows, row_grain(inner), [&](int64_t first, int64_t last) {
    std::vector<int64_t> index(rank, 0);
    std::array<int64_t, N> base{};
    for (int64_t d = rank - 2, rest = first; d >= 0; --d) {
      index[d] = rest % shape[d];
      rest /= shape[d];
      for (size_t j = 0; j < N; ++j) base[j] += index[d] * (*strides[j])[d];
    }
    for (int64_t row = first; row < last; ++row) {
      std::array<int64_t, N> offsets = base;
      for (int64_t i = 0; i < inner; ++i) {
        f(offsets);
        for (size_t j = 0; j < N; ++j) offsets[j] += inner_stride[j];
      }
      for (int64_t d = rank - 2; d >= 0; --d) {  // advance the odometer over the outer dims
        for (size_t j = 0; j < N; ++j) base[j] += (*strides[j])[d];
        if (++index[d] < shape[d]) break;
        for (size_t j = 0; j < N; ++j) base[j] -= (*strides[j])[d] * shape[d];
        index[d] = 0;
      }
    }
  });
}

// fn(i) for each of `rows` rows of `length` elements, blocks of row_grain(length) rows on the
// worker threads: for rows whose results are their own.
template <class Fn>
void for_each_row(int64_t rows, int64_t length, Fn&& fn) {
  parallel_for(rows, row_grain(length), [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) fn(i);
  });
}

template <class T>
constexpr bool is_float_v = std::is_floating_point_v<compute_t<T>>;

// body<T>() for a floating dtype; "<op>: not defined for <dtype>" for the others.
template <class Body>
void with_float(DType dtype, const char* op, Body&& body) {
  dispatch(dtype, [&]<class T>() {
    if constexpr (is_float_v<T>) body.template operator()<T>();
    else fail(op, ": not defined for ", name(dtype));
  });
}

// Value conversion between element types (through f32 for the 16-bit floats). Float to
// integer saturates, NaN to 0 (tensor/int_math.h), as the GPU converts.
template <class To, class From>
To convert(From v) {
  const compute_t<From> c = static_cast<compute_t<From>>(v);
  if constexpr (std::is_same_v<To, bool>) return c != compute_t<From>(0);
  else if constexpr (std::is_same_v<To, Half> || std::is_same_v<To, BFloat16>) return To(static_cast<float>(c));
  else if constexpr (std::is_integral_v<To> && is_float_v<From>) return saturating_cast<To>(c);
  else return static_cast<To>(c);
}

}  // namespace zg::cpu
