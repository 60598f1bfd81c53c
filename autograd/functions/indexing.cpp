// Indexing as rows of a matrix, over the embedding primitive: index_select picks rows of
// x with the indexed dim moved first; gather picks single elements, x's indexed dim moved
// last and the rows flattened to a column [M * C, 1], at index + row * C. Their gradients
// are embedding's scatter-add. scatter_add writes through that scatter-add
// (Backend::embedding_backward), and its gradient with respect to src is a gather. sort
// and topk take the sorting permutation from the backend's one primitive (sort_rows) and
// read their values by gather, which gives their gradient.
#include "autograd/functions.h"
#include "autograd/record.h"
#include "tensor/backend.h"
#include "tensor/checks.h"

namespace zg {

namespace {

const DifferentiableOp kScatterAdd("scatter_add");

int64_t product(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// Throws unless every index lies in [0, size) -- a host read of the extremes (a sync on a GPU),
// because a flat index past a row's end would read its neighbour's element without a fault.
// None on the meta device, which has no values (a dry run).
void check_range(const char* op, const Tensor& index, int64_t size, const Tensor& x) {
  if (index.numel() == 0 || index.device().type == DeviceType::meta) return;
  const auto low = min(index).to(DType::i64).item<int64_t>(), high = max(index).to(DType::i64).item<int64_t>();
  ZG_CHECK(low >= 0 && high < size, op, ": index out of range: indices span [", low, ", ", high,
           "] but the indexed dim of ", describe(x), " has size ", size);
}

// The checks gather and scatter_add share: index i32/i64 on x's device, of x's rank, no
// dim larger than x's but `dim`. Returns dim wrapped.
int64_t check_gather(const char* op, const Tensor& x, int64_t dim, const Tensor& index) {
  detail::check_floating(op, x);
  detail::check_index_dtype(op, index);
  ZG_CHECK(index.device() == x.device(), op, ": device mismatch: ", describe(x), " and index ", describe(index));
  ZG_CHECK(x.dim() >= 1 && index.dim() == x.dim(), op, ": index ", describe(index), " must have the rank of ",
           describe(x));
  dim = wrap_dim(dim, x.dim(), op);
  for (int64_t d = 0; d < x.dim(); ++d)
    ZG_CHECK(d == dim || index.size(d) <= x.size(d), op, ": index ", describe(index), " is larger than ", describe(x),
             " in dim ", d, " (only the indexed dim ", dim, " may be)");
  return dim;
}

// The part of x_moved (the indexed dim last) that index_moved [..., K] covers: a view cut to
// index's leading sizes, each row C = x_moved.size(-1) wide.
Tensor covered(const Tensor& x_moved, const Tensor& index_moved) {
  Tensor part = x_moved;
  for (int64_t d = 0; d + 1 < x_moved.dim(); ++d) part = part.narrow(d, 0, index_moved.size(d));
  return part;
}

// The flat positions row * C + index [M * K] (i64) of the elements index_moved addresses in
// the covered part taken as a column [M * C, 1]: what embedding reads and writes.
Tensor flat_positions(const Tensor& index_moved, int64_t width) {
  const int64_t count = index_moved.size(-1), rows = product(index_moved.shape()) / std::max<int64_t>(count, 1);
  const TensorOptions i64 = TensorOptions(DType::i64).device(index_moved.device());
  const Tensor starts = mul(arange(rows, i64), static_cast<double>(width)).unsqueeze(1);
  return add(starts, index_moved.to(DType::i64).reshape({rows, count})).reshape({-1});
}

}  // namespace

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  detail::check_floating("index_select", x);
  detail::check_index_dtype("index_select", index);
  ZG_CHECK(x.dim() >= 1 && index.dim() <= 1, "index_select: expected x of rank >= 1 and a 1-D index, got ",
           describe(x), " and ", describe(index));
  dim = wrap_dim(dim, x.dim(), "index_select");
  const Tensor moved = x.transpose(0, dim);
  Shape shape = moved.shape();
  const int64_t width = product(shape) / std::max<int64_t>(shape[0], 1);
  shape[0] = index.numel();
  const Tensor rows = moved.contiguous().reshape({moved.size(0), width});
  return embedding(rows, index.reshape({-1})).reshape(shape).transpose(0, dim).contiguous();
}

namespace {

// gather without the range check, for indices known in range (a sort's own positions): the
// check reads the indices' min and max back to the host, a wait on the device each.
Tensor gather_in_range(const Tensor& x, int64_t dim, const Tensor& index) {
  const Tensor index_moved = index.transpose(dim, -1);
  if (index.numel() == 0) return zeros(index.shape(), detail::options_of(x));
  const Tensor column = covered(x.transpose(dim, -1), index_moved).contiguous().reshape({-1, 1});
  return embedding(column, flat_positions(index_moved, x.size(dim))).reshape(index_moved.shape()).transpose(dim, -1).contiguous();
}

// x's values at a sort's positions along dim, by gather (its gradient); integers through
// f64, exact below 2^53.
Tensor values_at(const Tensor& x, int64_t dim, const Tensor& positions) {
  return is_floating(x.dtype()) ? gather_in_range(x, dim, positions)
                                : gather_in_range(x.to(DType::f64), dim, positions).to(x.dtype());
}

// The positions that sort x (detached) along dim: i64, x's shape.
Tensor sorted_positions(const Tensor& x, int64_t dim, bool descending) {
  const Tensor moved = x.detach().transpose(dim, -1).contiguous();
  const Tensor rows = detail::as_rows(moved);
  const Tensor order = empty(rows.shape(), TensorOptions(DType::i64).device(x.device()));
  backend(x.device()).sort_rows(rows, descending, order);
  return order.view(moved.shape()).transpose(dim, -1).contiguous();
}

}  // namespace

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  dim = check_gather("gather", x, dim, index);
  check_range("gather", index, x.size(dim), x);
  return gather_in_range(x, dim, index);
}

// out = x, then out[..., index[j], ...] += src[..., j, ...] along dim:  dx = g,  dsrc = gather(g, dim, index).
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  dim = check_gather("scatter_add", x, dim, index);
  detail::check_compatible("scatter_add", x, src);
  ZG_CHECK(src.shape() == index.shape(), "scatter_add: src ", describe(src), " and index ", describe(index),
           " must have one shape");
  check_range("scatter_add", index, x.size(dim), x);
  Tensor out;
  {
    NoGradGuard no_grad;  // one recorded op
    out = x.clone();
    if (index.numel() > 0) {
      const Tensor index_moved = index.transpose(dim, -1);
      Tensor target = covered(out.transpose(dim, -1), index_moved);
      const Tensor added = zeros({target.numel(), 1}, detail::options_of(out));
      const Tensor values = src.transpose(dim, -1).contiguous().reshape({-1, 1});
      backend(x.device()).embedding_backward(values, flat_positions(index_moved, x.size(dim)), added);
      target.add_(added.reshape(target.shape()));
    }
  }
  return differentiable(out, kScatterAdd, {x, src}, [index = SavedTensor(index), dim](const Tensor& g) {
    return std::vector<Tensor>{g, gather(g, dim, index.get("scatter_add"))};
  });
}

Tensor one_hot(const Tensor& indices, int64_t num_classes) {
  detail::check_index_dtype("one_hot", indices);
  if (num_classes < 0) {
    ZG_CHECK(indices.numel() > 0, "one_hot: cannot infer num_classes from an empty tensor; pass it");
    num_classes = max(indices).to(DType::i64).item<int64_t>() + 1;
  }
  check_range("one_hot", indices, num_classes, indices);
  const Tensor classes = arange(num_classes, TensorOptions(DType::i64).device(indices.device()));
  return eq(indices.to(DType::i64).unsqueeze(-1), classes).to(DType::i64);
}

SortResult sort(const Tensor& x, int64_t dim, bool descending) {
  detail::check_defined("sort", x);
  ZG_CHECK(x.dtype() != DType::boolean, "sort: bool tensors are not sorted; convert to an integer dtype first");
  if (x.dim() == 0) return {x, zeros({}, TensorOptions(DType::i64).device(x.device()))};
  dim = wrap_dim(dim, x.dim(), "sort");
  const Tensor indices = sorted_positions(x, dim, descending);
  return {values_at(x, dim, indices), indices};
}

SortResult topk(const Tensor& x, int64_t k, int64_t dim, bool largest) {
  detail::check_defined("topk", x);
  const int64_t size = x.dim() == 0 ? 1 : x.size(wrap_dim(dim, x.dim(), "topk"));
  ZG_CHECK(k >= 0 && k <= size, "topk: k ", k, " is outside [0, ", size, "], the size of dim ", dim, " of ", describe(x));
  if (x.dim() == 0) return sort(x);
  dim = wrap_dim(dim, x.dim(), "topk");
  const Tensor indices = sorted_positions(x, dim, largest).narrow(dim, 0, k).contiguous();
  return {values_at(x, dim, indices), indices};
}

}  // namespace zg
