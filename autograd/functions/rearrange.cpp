// Ops that move elements without arithmetic, composed of views, index_select and cat:
// their gradients are those of the parts (a flip's is a flip, a repeat's a sum over the
// copies, a pad's the slice of the gradient that x filled).
#include <algorithm>

#include "autograd/functions.h"
#include "tensor/checks.h"

namespace zg {

// Each dim of `dims` reversed by an index_select of n-1, ..., 0.
Tensor flip(const Tensor& x, const Shape& dims) {
  detail::check_floating("flip", x);
  Shape seen;
  Tensor out = x;
  for (int64_t d : dims) {
    d = wrap_dim(d, x.dim(), "flip");
    ZG_CHECK(std::find(seen.begin(), seen.end(), d) == seen.end(), "flip: dim ", d, " appears more than once in ",
             shape_str(dims));
    seen.push_back(d);
    const double n = static_cast<double>(x.size(d));
    if (n > 1) out = index_select(out, d, arange(n - 1, -1.0, -1.0, TensorOptions(DType::i64).device(x.device())));
  }
  return out.is_same(x) ? x.clone() : out;  // a new tensor, as torch.flip's
}

// Dim i of x (given leading 1s up to the rank of repeats) seen as [1, s_i], expanded to
// [r_i, s_i] and flattened: r_i copies of x one after another.
Tensor repeat(const Tensor& x, const Shape& repeats) {
  detail::check_defined("repeat", x);
  const int64_t rank = static_cast<int64_t>(repeats.size());
  ZG_CHECK(rank >= x.dim(), "repeat: ", shape_str(repeats), " gives fewer repeats than ", describe(x), " has dims");
  Shape padded(static_cast<size_t>(rank - x.dim()), 1);
  padded.insert(padded.end(), x.shape().begin(), x.shape().end());
  Shape interleaved, expanded, shape;
  for (int64_t i = 0; i < rank; ++i) {
    ZG_CHECK(repeats[i] >= 0, "repeat: negative repeat count in ", shape_str(repeats));
    interleaved.insert(interleaved.end(), {1, padded[i]});
    expanded.insert(expanded.end(), {repeats[i], padded[i]});
    shape.push_back(repeats[i] * padded[i]);
  }
  return x.reshape(interleaved).expand(expanded).reshape(shape);
}

namespace {

// x with `length` copies of `value` (the same shape but along dim) for cat.
Tensor filled(const Tensor& x, int64_t dim, int64_t length, double value) {
  Shape shape = x.shape();
  shape[dim] = length;
  return full(shape, value, detail::options_of(x));
}

Tensor pad_dim(const Tensor& x, int64_t dim, int64_t before, int64_t after, PadMode mode, double value) {
  const int64_t n = x.size(dim);
  if (mode == PadMode::constant) {
    // Negative pads crop first; what is left is padded.
    const int64_t start = std::max<int64_t>(0, -before), kept = n - start - std::max<int64_t>(0, -after);
    ZG_CHECK(kept >= 0, "pad: pads (", before, ", ", after, ") leave dim ", dim, " of ", describe(x),
             " a negative size");
    const Tensor core = x.narrow(dim, start, kept);
    std::vector<Tensor> parts;
    if (before > 0) parts.push_back(filled(x, dim, before, value));
    parts.push_back(core);
    if (after > 0) parts.push_back(filled(x, dim, after, value));
    return parts.size() == 1 ? core : cat(parts, dim);
  }
  ZG_CHECK(before >= 0 && after >= 0, "pad: ", mode == PadMode::reflect ? "reflect" : "replicate",
           " mode takes no negative pads, got (", before, ", ", after, ") for dim ", dim);
  if (before == 0 && after == 0) return x;
  if (mode == PadMode::reflect) {
    ZG_CHECK(before < n && after < n, "pad: reflect pads (", before, ", ", after, ") must be below the size ", n,
             " of dim ", dim, " of ", describe(x));
    return cat({flip(x.narrow(dim, 1, before), {dim}), x, flip(x.narrow(dim, n - 1 - after, after), {dim})}, dim);
  }
  ZG_CHECK(n > 0, "pad: replicate mode cannot pad dim ", dim, " of ", describe(x), ": it has no edge to repeat");
  Shape left = x.shape(), right = x.shape();
  left[dim] = before;
  right[dim] = after;
  return cat({x.narrow(dim, 0, 1).expand(left), x, x.narrow(dim, n - 1, 1).expand(right)}, dim);
}

}  // namespace

Tensor pad(const Tensor& x, const Shape& pad, PadMode mode, double value) {
  detail::check_defined("pad", x);
  const int64_t pairs = static_cast<int64_t>(pad.size() / 2);
  ZG_CHECK(pad.size() % 2 == 0 && pairs <= x.dim(), "pad: expected (before, after) pairs for at most the ", x.dim(),
           " dims of ", describe(x), ", got ", shape_str(pad));
  if (mode == PadMode::reflect) detail::check_floating("pad (reflect)", x);
  Tensor out = x;
  for (int64_t k = 0; k < pairs; ++k) out = pad_dim(out, x.dim() - 1 - k, pad[2 * k], pad[2 * k + 1], mode, value);
  return out;
}

}  // namespace zg
