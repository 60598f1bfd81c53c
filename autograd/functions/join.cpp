// cat writes each input into a narrow() view of the output; split, chunk and unbind return
// views; stack is a cat.
#include <algorithm>

#include "autograd/functions.h"
#include "autograd/record.h"
#include "tensor/checks.h"

namespace zg {

static const DifferentiableOp kCat("cat");

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  ZG_CHECK(!tensors.empty(), "cat: expected at least one tensor");
  const Tensor& first = tensors[0];
  detail::check_defined("cat", first);
  ZG_CHECK(first.dim() >= 1, "cat: cannot concatenate 0-dim tensors, got ", describe(first));
  dim = wrap_dim(dim, first.dim(), "cat");
  Shape shape = first.shape();
  shape[dim] = 0;
  for (const Tensor& t : tensors) {
    detail::check_compatible("cat", first, t);
    Shape expected = first.shape(), got = t.shape();
    ZG_CHECK(got.size() == expected.size(), "cat: tensors must have one rank, got ", describe(first), " and ",
             describe(t));
    expected[dim] = got[dim];
    ZG_CHECK(got == expected, "cat: shapes ", shape_str(first.shape()), " and ", shape_str(t.shape()),
             " differ outside dim ", dim);
    shape[dim] += got[dim];
  }
  Tensor out = empty(shape, detail::options_of(first));
  Shape sizes;
  {
    NoGradGuard no_grad;  // the copies are one recorded op
    int64_t start = 0;
    for (const Tensor& t : tensors) {
      out.narrow(dim, start, t.size(dim)).copy_(t);
      start += t.size(dim);
      sizes.push_back(t.size(dim));
    }
  }
  // The gradient of each input is its slice of the output's gradient.
  return differentiable(out, kCat, tensors, [sizes, dim](const Tensor& g) { return split(g, sizes, dim); });
}

// stack = cat of the tensors, each given a size-1 dim at `dim`.
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  ZG_CHECK(!tensors.empty(), "stack: expected at least one tensor");
  detail::check_defined("stack", tensors[0]);
  dim = wrap_dim(dim, tensors[0].dim() + 1, "stack");
  std::vector<Tensor> parts;
  for (const Tensor& t : tensors) {
    detail::check_defined("stack", t);
    ZG_CHECK(t.shape() == tensors[0].shape(), "stack: tensors must have one shape, got ", describe(tensors[0]),
             " and ", describe(t));
    parts.push_back(t.unsqueeze(dim));
  }
  return cat(parts, dim);
}

std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim) {
  detail::check_defined("split", x);
  ZG_CHECK(split_size > 0, "split: split_size must be positive, got ", split_size);
  dim = wrap_dim(dim, x.dim(), "split");
  std::vector<Tensor> parts;
  for (int64_t start = 0; start < x.size(dim); start += split_size)
    parts.push_back(x.narrow(dim, start, std::min(split_size, x.size(dim) - start)));
  if (parts.empty()) parts.push_back(x.narrow(dim, 0, 0));  // a zero-size dim: one empty part, as in PyTorch
  return parts;
}

std::vector<Tensor> split(const Tensor& x, const Shape& sizes, int64_t dim) {
  detail::check_defined("split", x);
  dim = wrap_dim(dim, x.dim(), "split");
  int64_t total = 0;
  for (int64_t s : sizes) {
    ZG_CHECK(s >= 0, "split: negative size in ", shape_str(sizes));
    total += s;
  }
  ZG_CHECK(total == x.size(dim), "split: sizes ", shape_str(sizes), " do not add up to ", x.size(dim), ", the size of dim ",
           dim, " of ", describe(x));
  std::vector<Tensor> parts;
  int64_t start = 0;
  for (int64_t s : sizes) {
    parts.push_back(x.narrow(dim, start, s));
    start += s;
  }
  return parts;
}

// chunk = split into pieces of ceil(size / chunks) (1 at least: a zero-size dim gives one empty part).
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  detail::check_defined("chunk", x);
  ZG_CHECK(chunks > 0, "chunk: chunks must be positive, got ", chunks);
  dim = wrap_dim(dim, x.dim(), "chunk");
  return split(x, std::max<int64_t>(1, (x.size(dim) + chunks - 1) / chunks), dim);
}

std::vector<Tensor> unbind(const Tensor& x, int64_t dim) {
  detail::check_defined("unbind", x);
  ZG_CHECK(x.dim() >= 1, "unbind: cannot unbind a 0-d tensor");
  dim = wrap_dim(dim, x.dim(), "unbind");
  std::vector<Tensor> slices;
  for (int64_t i = 0; i < x.size(dim); ++i) slices.push_back(x.select(dim, i));
  return slices;
}

}  // namespace zg
