// Tensor's differentiable methods -- views, conversions and clone, each recording its
// backward formula -- and its in-place writes, which autograd guards: they refuse a
// tensor that requires grad and bump the version a SavedTensor checks. Declared in
// tensor/tensor.h, with the rest of Tensor.
#include <algorithm>
#include <optional>

#include "autograd/functions.h"
#include "autograd/record.h"
#include "tensor/backend.h"
#include "tensor/checks.h"
#include "tensor/deferred.h"
#include "tensor/tensor.h"

namespace zg {

namespace {

Tensor make_view(const Tensor& base, Shape shape, Shape strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = base.storage();
  impl->offset = offset;
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->dtype = base.dtype();
  return Tensor(std::move(impl));
}

// Replaces a single -1 in `shape` by the size that makes it hold `count` elements.
Shape infer_size(Shape shape, int64_t count, const char* op) {
  int64_t known = 1;
  int infer_at = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      ZG_CHECK(infer_at < 0, op, ": only one dimension can be -1, got ", shape_str(shape));
      infer_at = static_cast<int>(i);
    } else {
      ZG_CHECK(shape[i] >= 0, op, ": invalid size ", shape[i], " in shape ", shape_str(shape));
      ZG_CHECK(!__builtin_mul_overflow(known, shape[i], &known), op, ": shape ", shape_str(shape),
               " has more elements than an int64 can count");
    }
  }
  if (infer_at >= 0) {
    ZG_CHECK(known != 0 && count % known == 0, op, ": shape ", shape_str(shape), " is invalid for a tensor of ", count,
             " elements");
    shape[infer_at] = count / known;
  }
  ZG_CHECK(numel(shape) == count, op, ": shape ", shape_str(shape), " is invalid for a tensor of ", count, " elements");
  return shape;
}

// Strides that let `new_shape` view memory laid out as (old_shape, old_strides),
// if any exist: each run of old dims that is contiguous in memory may be split or
// merged freely (the algorithm of PyTorch's computeStride).
std::optional<Shape> view_strides(const Shape& old_shape, const Shape& old_strides, const Shape& new_shape) {
  if (old_shape.empty() || numel(old_shape) == 0) return contiguous_strides(new_shape);
  Shape new_strides(new_shape.size());
  int64_t view_d = static_cast<int64_t>(new_shape.size()) - 1;
  int64_t chunk_base_stride = old_strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t tensor_d = static_cast<int64_t>(old_shape.size()) - 1; tensor_d >= 0; --tensor_d) {
    tensor_numel *= old_shape[tensor_d];
    const bool chunk_ends = tensor_d == 0 || (old_shape[tensor_d - 1] != 1 &&
                                              old_strides[tensor_d - 1] != tensor_numel * chunk_base_stride);
    if (!chunk_ends) continue;
    while (view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d] == 1)) {
      new_strides[view_d] = view_numel * chunk_base_stride;
      view_numel *= new_shape[view_d];
      --view_d;
    }
    if (view_numel != tensor_numel) return std::nullopt;
    if (tensor_d > 0) {
      chunk_base_stride = old_strides[tensor_d - 1];
      tensor_numel = 1;
      view_numel = 1;
    }
  }
  if (view_d != -1) return std::nullopt;
  return new_strides;
}

const DifferentiableOp kView("view"), kPermute("permute"), kTranspose("transpose"), kNarrow("narrow"),
    kSlice("slice"), kSelect("select"), kExpand("expand"), kSqueeze("squeeze"), kUnsqueeze("unsqueeze"),
    kClone("clone"), kToDType("to_dtype"), kToDevice("to_device");

// Views whose gradient is the incoming one reshaped back to the input's shape.
Tensor record_reshaping(const Tensor& out, const Tensor& in, const DifferentiableOp& op) {
  if (needs_grad({&in}))
    record(out, op, {in}, [shape = in.shape()](const Tensor& g) { return std::vector<Tensor>{g.reshape(shape)}; });
  return out;
}

// Views of part of the input (narrow, slice, select): the gradient is zero outside
// the part; `part_of` applies the same view to a zero tensor of the input's shape.
template <class PartOf>
Tensor record_part(const Tensor& out, const Tensor& in, const DifferentiableOp& op, PartOf part_of) {
  if (needs_grad({&in}))
    record(out, op, {in}, [shape = in.shape(), part_of](const Tensor& g) {
      Tensor grad = zeros(shape, TensorOptions(g.dtype()).device(g.device()));
      part_of(grad).copy_(g);
      return std::vector<Tensor>{grad};
    });
  return out;
}

// The source of an in-place write (dst[i] op= src[i], src already expanded to dst's
// shape), as the write may read it: a copy when the two overlap other than element for
// element (x.copy_(x.t()), x[1:] += x[:-1]) -- read while written, those would see
// values already overwritten. memmove's rule, for strided views.
Tensor unaliased_source(const Tensor& src, const Tensor& dst) {
  if (src.storage() != dst.storage() || src.numel() == 0 || dst.numel() == 0) return src;
  if (src.offset() == dst.offset() && src.strides() == dst.strides()) return src;  // the same elements
  const auto [src_first, src_last] = storage_range(src);
  const auto [dst_first, dst_last] = storage_range(dst);
  if (src_last <= dst_first || dst_last <= src_first) return src;
  Tensor staged = Tensor::empty(src.shape(), TensorOptions(src.dtype()).device(src.device()));
  backend(src.device()).copy(src, staged);
  return staged;
}

// An in-place write records no gradient: from a source that requires grad (under grad
// mode) the gradient would be lost without a trace.
void check_source_needs_no_grad(const Tensor& src, const char* op) {
  ZG_CHECK(!(GradMode::is_enabled() && src.requires_grad()), op, ": the source ", describe(src),
           " requires grad, and an in-place write records no gradient for it; use an op that does "
           "(clone(), to(), +), or write a detach()ed source or under NoGradGuard");
}

}  // namespace

void begin_inplace(const Tensor& t, const char* op) {
  ZG_CHECK(!(GradMode::is_enabled() && t.requires_grad()), op, ": in-place write to ", describe(t),
           ", which requires grad; do it under NoGradGuard (or on a detach()ed tensor)");
  t.storage()->bump_version();
}

// ---- views ----

Tensor Tensor::view(const Shape& shape) const {
  const Shape target = infer_size(shape, numel(), "view");
  auto strides = view_strides(this->shape(), this->strides(), target);
  ZG_CHECK(strides.has_value(), "view: cannot view a tensor of shape ", shape_str(this->shape()), " and strides ",
           shape_str(this->strides()), " as shape ", shape_str(target), "; call contiguous() first or use reshape()");
  return record_reshaping(make_view(*this, target, *strides, offset()), *this, kView);
}

Tensor Tensor::reshape(const Shape& shape) const {
  const Shape target = infer_size(shape, numel(), "reshape");
  if (auto strides = view_strides(this->shape(), this->strides(), target))
    return record_reshaping(make_view(*this, target, *strides, offset()), *this, kView);
  return contiguous().view(target);
}

Tensor Tensor::permute(const Shape& dims) const {
  ZG_CHECK(static_cast<int64_t>(dims.size()) == dim(), "permute: dims ", shape_str(dims), " do not match a tensor of rank ",
           dim());
  Shape shape(dims.size()), strides(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t d = wrap_dim(dims[i], dim(), "permute");
    ZG_CHECK(!seen[d], "permute: dims ", shape_str(dims), " are not a permutation (dim ", d, " repeats)");
    seen[d] = true;
    shape[i] = this->shape()[d];
    strides[i] = this->strides()[d];
  }
  const Tensor out = make_view(*this, shape, strides, offset());
  if (needs_grad({this}))
    record(out, kPermute, {*this}, [dims, rank = dim()](const Tensor& g) {
      Shape inverse(dims.size());
      for (size_t i = 0; i < dims.size(); ++i) inverse[wrap_dim(dims[i], rank, "permute")] = static_cast<int64_t>(i);
      return std::vector<Tensor>{g.permute(inverse)};
    });
  return out;
}

Tensor Tensor::transpose(int64_t dim0, int64_t dim1) const {
  dim0 = wrap_dim(dim0, dim(), "transpose");
  dim1 = wrap_dim(dim1, dim(), "transpose");
  Shape shape = this->shape(), strides = this->strides();
  std::swap(shape[dim0], shape[dim1]);
  std::swap(strides[dim0], strides[dim1]);
  const Tensor out = make_view(*this, shape, strides, offset());
  if (needs_grad({this}))
    record(out, kTranspose, {*this},
           [dim0, dim1](const Tensor& g) { return std::vector<Tensor>{g.transpose(dim0, dim1)}; });
  return out;
}

Tensor Tensor::t() const {
  ZG_CHECK(dim() >= 2, "t: expected a tensor of rank >= 2, got ", describe(*this));
  return transpose(-2, -1);
}

Tensor Tensor::narrow(int64_t dim, int64_t start, int64_t length) const {
  dim = wrap_dim(dim, this->dim(), "narrow");
  const int64_t size = shape()[dim];
  if (start < 0) start += size;
  ZG_CHECK(start >= 0 && length >= 0 && start <= size && length <= size - start, "narrow: start ", start, " and length ", length,
           " are out of range for dim ", dim, " of size ", size, " (shape ", shape_str(shape()), ")");
  Shape shape = this->shape();
  shape[dim] = length;
  return record_part(make_view(*this, shape, strides(), offset() + start * strides()[dim]), *this, kNarrow,
                     [dim, start, length](const Tensor& t) { return t.narrow(dim, start, length); });
}

Tensor Tensor::slice(int64_t dim, int64_t start, int64_t end, int64_t step) const {
  dim = wrap_dim(dim, this->dim(), "slice");
  ZG_CHECK(step > 0, "slice: step must be positive, got ", step);
  const int64_t size = shape()[dim];
  if (start < 0) start += size;
  if (end < 0) end += size;
  start = std::clamp<int64_t>(start, 0, size);
  end = std::clamp<int64_t>(end, start, size);
  Shape shape = this->shape(), strides = this->strides();
  // ceil((end - start) / step), written so a huge step cannot overflow. With two or more
  // elements step < size, so stride * step stays within the offsets the input reaches.
  shape[dim] = end == start ? 0 : (end - start - 1) / step + 1;
  if (shape[dim] > 1) strides[dim] *= step;
  return record_part(make_view(*this, shape, strides, offset() + start * this->strides()[dim]), *this, kSlice,
                     [dim, start, end, step](const Tensor& t) { return t.slice(dim, start, end, step); });
}

Tensor Tensor::select(int64_t dim, int64_t index) const {
  dim = wrap_dim(dim, this->dim(), "select");
  const int64_t size = shape()[dim];
  ZG_CHECK(index >= -size && index < size, "select: index ", index, " is out of range for dim ", dim, " of size ",
           size);
  if (index < 0) index += size;
  Shape shape = this->shape(), strides = this->strides();
  shape.erase(shape.begin() + dim);
  strides.erase(strides.begin() + dim);
  return record_part(make_view(*this, shape, strides, offset() + index * this->strides()[dim]), *this, kSelect,
                     [dim, index](const Tensor& t) { return t.select(dim, index); });
}

Tensor Tensor::expand(const Shape& target) const {
  ZG_CHECK(target.size() >= shape().size(), "expand: cannot expand shape ", shape_str(shape()), " to ", shape_str(target),
           " (fewer dims)");
  const size_t lead = target.size() - shape().size();
  Shape shape(target.size()), strides(target.size(), 0);
  for (size_t i = 0; i < target.size(); ++i) {
    if (i < lead) {
      ZG_CHECK(target[i] >= 0, "expand: cannot expand shape ", shape_str(this->shape()), " to ", shape_str(target));
      shape[i] = target[i];
      continue;
    }
    const int64_t old = this->shape()[i - lead];
    const int64_t want = target[i] == -1 ? old : target[i];
    ZG_CHECK(want >= 0 && (want == old || old == 1), "expand: cannot expand shape ", shape_str(this->shape()), " to ",
             shape_str(target));
    shape[i] = want;
    strides[i] = want == old ? this->strides()[i - lead] : 0;
  }
  zg::numel(shape, "expand");  // throws for sizes whose element count overflows int64
  const Tensor out = make_view(*this, shape, strides, offset());
  if (needs_grad({this}))
    record(out, kExpand, {*this}, [original = this->shape()](const Tensor& g) {
      return std::vector<Tensor>{sum_to(g, original)};
    });
  return out;
}

Tensor Tensor::squeeze() const {
  Shape shape, strides;
  for (int64_t d = 0; d < dim(); ++d) {
    if (this->shape()[d] == 1) continue;
    shape.push_back(this->shape()[d]);
    strides.push_back(this->strides()[d]);
  }
  return record_reshaping(make_view(*this, shape, strides, offset()), *this, kSqueeze);
}

Tensor Tensor::squeeze(int64_t dim) const {
  dim = wrap_dim(dim, this->dim(), "squeeze");
  if (shape()[dim] != 1) return *this;
  Shape shape = this->shape(), strides = this->strides();
  shape.erase(shape.begin() + dim);
  strides.erase(strides.begin() + dim);
  return record_reshaping(make_view(*this, shape, strides, offset()), *this, kSqueeze);
}

Tensor Tensor::unsqueeze(int64_t dim) const {
  // dim indexes the result, of rank dim() + 1 (the error names both).
  ZG_CHECK(dim >= -(this->dim() + 1) && dim <= this->dim(), "unsqueeze: dim ", dim, " is out of range for ",
           describe(*this), " (a new dim goes at -", this->dim() + 1, " to ", this->dim(), ")");
  dim = wrap_dim(dim, this->dim() + 1, "unsqueeze");
  Shape shape = this->shape(), strides = this->strides();
  const int64_t stride = dim < this->dim() ? this->strides()[dim] * this->shape()[dim] : 1;
  shape.insert(shape.begin() + dim, 1);
  strides.insert(strides.begin() + dim, stride);
  return record_reshaping(make_view(*this, shape, strides, offset()), *this, kUnsqueeze);
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

// ---- copies and conversions ----

Tensor& Tensor::copy_(const Tensor& src) {
  check_materialized("copy_", *this);
  detail::check_defined("copy_", src);
  detail::check_no_broadcast_dims("copy_", "destination", *this);
  check_source_needs_no_grad(src, "copy_");
  begin_inplace(*this, "copy_");
  const Tensor source = unaliased_source(src.shape() == shape() ? src : src.expand(shape()), *this);
  const Device from = source.device(), to = device();
  if (to.type == DeviceType::meta) return *this;  // meta tensors hold no data
  ZG_CHECK(from.type != DeviceType::meta, "copy_: cannot copy data out of a meta tensor (", describe(source),
           "); meta tensors have shapes but no data");
  backend(from.type == DeviceType::cpu ? to : from).copy(source, *this);
  return *this;
}

Tensor& Tensor::fill_(double value) {
  // As a scalar operand (scalar_like): saturating 1e20 into an i32, NaN into 0 or 1e6
  // into an f16 inf would fill with another value than the one asked for.
  check_materialized("fill_", *this);
  ZG_CHECK(detail::holds(dtype(), value), "fill_: the value ", value, " does not fit ", describe(*this));
  detail::check_no_broadcast_dims("fill_", "destination", *this);
  begin_inplace(*this, "fill_");
  backend(device()).fill(*this, value);
  return *this;
}

Tensor& Tensor::add_(const Tensor& other, double alpha) {
  detail::check_compatible("add_", *this, other);
  ZG_CHECK(broadcast_shapes(shape(), other.shape(), "add_") == shape(), "add_: ", describe(other),
           " does not broadcast to ", describe(*this));
  detail::check_no_broadcast_dims("add_", "destination", *this);
  check_source_needs_no_grad(other, "add_");
  const Tensor scaled = alpha == 1.0 ? other : mul(other, detail::scalar_like("add_", other, alpha));
  begin_inplace(*this, "add_");
  backend(device()).binary(BinaryOp::add, *this, unaliased_source(scaled.expand(shape()), *this), *this);
  return *this;
}

Tensor& Tensor::mul_(double factor) {
  check_materialized("mul_", *this);
  const Tensor scalar = detail::scalar_like("mul_", *this, factor);
  detail::check_no_broadcast_dims("mul_", "destination", *this);
  begin_inplace(*this, "mul_");
  backend(device()).binary(BinaryOp::mul, *this, scalar.expand(shape()), *this);
  return *this;
}

// A new tensor holding this one's values; `op`'s gradient maps back through `back`.
template <class Back>
static Tensor converted(const Tensor& src, TensorOptions options, const DifferentiableOp& op, Back back) {
  check_materialized(op.name(), src);
  Tensor out = Tensor::empty(src.shape(), options);
  {
    NoGradGuard no_grad;  // the copy itself is recorded below as one op
    out.copy_(src);
  }
  if (needs_grad({&src})) record(out, op, {src}, [back](const Tensor& g) { return std::vector<Tensor>{back(g)}; });
  return out;
}

Tensor Tensor::to(Device device) const {
  if (device == this->device()) return *this;
  return converted(*this, TensorOptions(dtype()).device(device), kToDevice,
                   [from = this->device()](const Tensor& g) { return g.to(from); });
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == this->dtype()) return *this;
  return converted(*this, TensorOptions(dtype).device(device()), kToDType,
                   [from = this->dtype()](const Tensor& g) { return g.to(from); });
}

Tensor Tensor::clone() const {
  return converted(*this, TensorOptions(dtype()).device(device()), kClone, [](const Tensor& g) { return g; });
}

}  // namespace zg
