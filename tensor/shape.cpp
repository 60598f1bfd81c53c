#include "tensor/shape.h"

#include <algorithm>

#include "tensor/error.h"

namespace zg {

// A shape is valid only if the product of its non-zero sizes fits an int64: that product
// bounds every contiguous stride and offset, even where a zero size makes it empty.
int64_t numel(const Shape& shape, const char* op) {
  int64_t n = 1;
  bool empty = false;
  for (int64_t s : shape) {
    if (s == 0) {
      empty = true;
      continue;
    }
    ZG_CHECK(!__builtin_mul_overflow(n, s, &n), op ? op : "", op ? ": " : "", "shape ", shape_str(shape),
             " has more elements than an int64 can count");
  }
  return empty ? 0 : n;
}

Shape contiguous_strides(const Shape& shape) {
  numel(shape);  // throws where the strides would overflow
  Shape strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

std::string shape_str(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t wrap_dim(int64_t dim, int64_t rank, const char* op) {
  const int64_t wrapped = dim < 0 ? dim + rank : dim;
  ZG_CHECK(wrapped >= 0 && wrapped < rank, op, ": dim ", dim, " is out of range for a tensor of rank ", rank);
  return wrapped;
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const size_t rank = std::max(a.size(), b.size());
  Shape out(rank);
  for (size_t i = 0; i < rank; ++i) {
    const int64_t sa = i < rank - a.size() ? 1 : a[i - (rank - a.size())];
    const int64_t sb = i < rank - b.size() ? 1 : b[i - (rank - b.size())];
    ZG_CHECK(sa == sb || sa == 1 || sb == 1, op, ": cannot broadcast shapes ", shape_str(a), " and ", shape_str(b));
    out[i] = sa == 1 ? sb : sa;
  }
  return out;
}

}  // namespace zg
