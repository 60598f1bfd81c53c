#include "tensor/slice_index.h"

namespace zg {

namespace {

// The whole tensor as [outer, chunks, parts, m, inner] along the cut dim; a slice is
// [outer, chunks, m, inner]. Both orders keep (m - i) inner - e elements consecutive from
// row i, element e of a block of m rows.
struct Blocks {
  int64_t outer = 1, dim, chunks, parts, m, inner = 1, slice;
};
Blocks blocks_of(const SliceIndex& index) {
  Blocks b{1, index.whole.at(index.dim), index.chunks, index.parts, 0, 1, 0};
  for (int64_t i = 0; i < index.dim; ++i) b.outer *= index.whole[i];
  for (size_t i = index.dim + 1; i < index.whole.size(); ++i) b.inner *= index.whole[i];
  b.m = b.dim / (b.chunks * b.parts);
  b.slice = numel(index.whole) / b.parts;
  return b;
}

}  // namespace

int64_t SliceIndex::element(int64_t p, int64_t& run) const {
  if (parts == 1) return run = numel(whole) - p, p;
  const Blocks b = blocks_of(*this);
  const int64_t t = p / b.slice, q = p % b.slice;
  const int64_t o = q / (b.chunks * b.m * b.inner), j = q / b.inner % (b.chunks * b.m), e = q % b.inner;
  const int64_t k = j / b.m, i = j % b.m;
  run = (b.m - i) * b.inner - e;
  return ((o * b.chunks + k) * b.parts * b.m + t * b.m + i) * b.inner + e;
}

int64_t SliceIndex::position(int64_t w, int64_t& run) const {
  if (parts == 1) return run = numel(whole) - w, w;
  const Blocks b = blocks_of(*this);
  const int64_t o = w / (b.dim * b.inner), d = w / b.inner % b.dim, e = w % b.inner;
  const int64_t k = d / (b.parts * b.m), t = d % (b.parts * b.m) / b.m, i = d % b.m;
  run = (b.m - i) * b.inner - e;
  return t * b.slice + ((o * b.chunks + k) * b.m + i) * b.inner + e;
}

}  // namespace zg
