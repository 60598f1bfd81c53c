// Shapes and strides are plain vectors of int64, in elements (not bytes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zg {

using Shape = std::vector<int64_t>;

// Throws zg::Error (naming `op` when given) where the count overflows int64.
int64_t numel(const Shape& shape, const char* op = nullptr);
Shape contiguous_strides(const Shape& shape);
std::string shape_str(const Shape& shape);  // "[2, 3]"

// Wraps a negative dim (-1 = last) and checks it against `rank`:
// "<op>: dim 3 is out of range for a tensor of rank 2".
int64_t wrap_dim(int64_t dim, int64_t rank, const char* op);

// NumPy/PyTorch broadcasting: align right, sizes must match or be 1.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

}  // namespace zg
