// Where a slice's elements sit in the whole tensor, for tensor parallelism's cut: the
// whole cut along `dim` into `chunks` equal blocks, each block into `parts` equal pieces,
// slice t holding piece t of every block (nn::TensorSplit). Positions count the slices one
// after another, each flattened ("slice-major" order: slice t from t numel / parts); a
// position and a whole element map to each other in runs consecutive in both. A deferred
// slice draws its values through it (tensor/deferred.h), a checkpoint stores cut
// parameters in its order (dist/zero/checkpoint/slice_order.h).
#pragma once

#include <cstdint>

#include "tensor/shape.h"

namespace zg {

struct SliceIndex {
  Shape whole;
  int64_t dim = 0, chunks = 1, parts = 1;  // parts = 1: not cut, positions are elements

  // The whole tensor's element at position p; `run`: how many positions from p are
  // consecutive elements there too.
  int64_t element(int64_t p, int64_t& run) const;
  // The inverse: element w's position; `run`: how many elements from w are consecutive positions.
  int64_t position(int64_t w, int64_t& run) const;
};

}  // namespace zg
