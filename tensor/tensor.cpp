#include "tensor/tensor.h"

#include <algorithm>
#include <cmath>

#include "tensor/backend.h"
#include "tensor/checks.h"
#include "tensor/context.h"
#include "tensor/deferred.h"
#include "tensor/init_recipe.h"

namespace zg {

int64_t Tensor::nbytes() const {
  int64_t bytes = 0;
  ZG_CHECK(!__builtin_mul_overflow(numel(), element_size(), &bytes), "nbytes: ", describe(*this),
           " has more bytes than an int64 can count");
  return bytes;
}

TensorImpl& Tensor::impl() const {
  ZG_CHECK(impl_ != nullptr, "tensor: use of an undefined tensor");
  return *impl_;
}

namespace {

// The size of a new tensor of this shape and dtype; throws for a negative size or overflow.
int64_t new_tensor_bytes(const Shape& shape, DType dtype) {
  int64_t bytes = zg::element_size(dtype);
  for (int64_t s : shape) {
    ZG_CHECK(s >= 0, "empty: negative size in shape ", shape_str(shape));
    ZG_CHECK(!__builtin_mul_overflow(bytes, s, &bytes), "empty: shape ", shape_str(shape), " of ", name(dtype),
             " is too large (its size in bytes overflows 64 bits)");
  }
  return bytes;
}

Tensor contiguous_over(std::shared_ptr<Storage> storage, const Shape& shape, DType dtype) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

// The allocator a new tensor with these options comes from: the device's, or the host pool's.
std::shared_ptr<Allocator> allocator_for(const TensorOptions& options) {
  Context& context = Context::current();
  return options.is_pinned() ? context.host_allocator(options.device()) : context.allocator(options.device());
}

}  // namespace

Tensor Tensor::empty(const Shape& shape, TensorOptions options) {
  const int64_t bytes = new_tensor_bytes(shape, options.dtype());
  return contiguous_over(std::make_shared<Storage>(allocator_for(options), bytes, MemoryScope::current()), shape,
                         options.dtype());
}

Tensor deferred_tensor(const Shape& shape, TensorOptions options, const InitRecipe& recipe) {
  const int64_t bytes = new_tensor_bytes(shape, options.dtype());
  return contiguous_over(
      Storage::deferred(allocator_for(options), bytes, std::make_shared<const InitRecipe>(recipe)), shape,
      options.dtype());
}

Tensor Tensor::empty_released(const Shape& shape, TensorOptions options) {
  const int64_t bytes = new_tensor_bytes(shape, options.dtype());
  return contiguous_over(Storage::unallocated(allocator_for(options), bytes, MemoryScope::current()), shape,
                         options.dtype());
}

int64_t Tensor::size(int64_t dim) const { return shape()[wrap_dim(dim, this->dim(), "size")]; }

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (int64_t d = dim() - 1; d >= 0; --d) {
    if (shape()[d] == 0) return true;
    if (shape()[d] != 1 && strides()[d] != expected) return false;
    expected *= shape()[d];
  }
  return true;
}

void* Tensor::data_ptr() const {
  auto* base = static_cast<char*>(storage()->data());
  return base ? base + offset() * element_size() : nullptr;
}

namespace {
void check_readable(const Tensor& t, const char* op) {
  ZG_CHECK(t.device().type != DeviceType::meta, op, ": cannot read data of a meta tensor (", describe(t),
           "); meta tensors have shapes but no data");
  check_materialized(op, t);
}
}  // namespace

template <class T>
T Tensor::item() const {
  ZG_CHECK(numel() == 1, "item: expected a tensor with exactly 1 element, got ", describe(*this));
  check_readable(*this, "item");
  return to_vector<T>()[0];
}

template <class T>
std::vector<T> Tensor::to_vector() const {
  check_readable(*this, "to_vector");
  const Tensor host = to(kCPU).to(dtype_of<T>()).contiguous();
  const T* data = host.data<T>();
  return std::vector<T>(data, data + host.numel());
}

std::string describe(const Tensor& t) {
  if (!t.defined()) return "undefined tensor";
  return std::string(name(t.dtype())) + shape_str(t.shape()) + " on " + t.device().str();
}

std::pair<int64_t, int64_t> storage_range(const Tensor& t) {
  int64_t last = t.offset() + 1;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.shape()[d] - 1) * t.strides()[d];
  return {t.offset(), last};
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

// ---- factories ----

// Under DeferredInit the factories return tensors that hold a recipe instead of values
// (tensor/deferred.h); Tensor::empty, which ops make their outputs with, never does.
static InitRecipe recipe(InitRecipe::Kind kind, DType dtype, double value = 0, RandomSpec random = {}) {
  return {kind, dtype, value, random};
}
Tensor empty(const Shape& shape, TensorOptions options) {
  if (DeferredInit::is_active())
    return deferred_tensor(shape, options, recipe(InitRecipe::Kind::undefined, options.dtype()));
  return Tensor::empty(shape, options);
}
Tensor zeros(const Shape& shape, TensorOptions options) { return full(shape, 0.0, options); }
Tensor ones(const Shape& shape, TensorOptions options) { return full(shape, 1.0, options); }
Tensor full(const Shape& shape, double value, TensorOptions options) {
  if (DeferredInit::is_active()) {
    ZG_CHECK(detail::holds(options.dtype(), value), "full: the value ", value, " does not fit ", name(options.dtype()));
    return deferred_tensor(shape, options, recipe(InitRecipe::Kind::constant, options.dtype(), value));
  }
  Tensor t = Tensor::empty(shape, options);
  t.fill_(value);
  return t;
}
static TensorOptions options_of(const Tensor& t) { return TensorOptions(t.dtype()).device(t.device()); }
Tensor empty_like(const Tensor& t) { return empty(t.shape(), options_of(t)); }
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), options_of(t)); }
Tensor ones_like(const Tensor& t) { return ones(t.shape(), options_of(t)); }
Tensor full_like(const Tensor& t, double value) { return full(t.shape(), value, options_of(t)); }

Tensor arange(int64_t end, TensorOptions options) { return arange(0.0, static_cast<double>(end), 1.0, options); }

// A tensor of `shape` whose element i (row-major) is value(i): written on the host in f64
// (through the allocator, so a huge one is a clean OutOfMemory), then converted and moved.
// On the meta device, the shape alone.
template <class Value>
static Tensor from_host_values(const Shape& shape, TensorOptions options, Value value) {
  if (options.device().type == DeviceType::meta) return Tensor::empty(shape, options);
  Tensor host = Tensor::empty(shape, DType::f64);
  double* values = host.data<double>();
  for (int64_t i = 0; i < host.numel(); ++i) values[i] = value(i);
  return host.to(options.dtype()).to(options.device());
}

Tensor arange(double start, double end, double step, TensorOptions options) {
  ZG_CHECK(step != 0 && std::isfinite(start) && std::isfinite(end) && std::isfinite(step),
           "arange: invalid range start=", start, " end=", end, " step=", step);
  const double count = std::max(0.0, std::ceil((end - start) / step));
  ZG_CHECK(count < 9e18, "arange: range start=", start, " end=", end, " step=", step, " is too long");
  // Every value must be one of the dtype's (an integer dtype takes no fraction): checked
  // at both ends and the step, as the values run between them.
  const double last = start + std::max(0.0, count - 1) * step;
  ZG_CHECK(detail::holds(options.dtype(), start) && detail::holds(options.dtype(), step) &&
               detail::holds(options.dtype(), last),
           "arange: the values from ", start, " by ", step, " to ", last, " do not all fit ", name(options.dtype()),
           is_floating(options.dtype()) ? "" : " (whole numbers in its range; pass a floating-point dtype for fractions)");
  return from_host_values({static_cast<int64_t>(count)}, options,
                          [&](int64_t i) { return start + static_cast<double>(i) * step; });
}

// torch.linspace's formula: the first half start + i step, the second end - (steps - 1 - i) step
// (one step: start).
Tensor linspace(double start, double end, int64_t steps, TensorOptions options) {
  ZG_CHECK(steps >= 0 && std::isfinite(start) && std::isfinite(end), "linspace: expected finite ends and steps >= 0, got ",
           "start=", start, " end=", end, " steps=", steps);
  ZG_CHECK(options.dtype() != DType::boolean && detail::holds(options.dtype(), std::trunc(start)) &&
               detail::holds(options.dtype(), std::trunc(end)),
           "linspace: the values from ", start, " to ", end, " do not fit ", name(options.dtype()));
  const double step = steps > 1 ? (end - start) / static_cast<double>(steps - 1) : 0.0;
  return from_host_values({steps}, options, [&](int64_t i) {
    if (steps == 1) return start;
    return i < steps / 2 ? start + static_cast<double>(i) * step : end - static_cast<double>(steps - 1 - i) * step;
  });
}

Tensor eye(int64_t n, int64_t m, TensorOptions options) {
  if (m < 0) m = n;
  ZG_CHECK(n >= 0, "eye: expected n >= 0, got ", n);
  return from_host_values({n, m}, options, [m](int64_t i) { return i / m == i % m ? 1.0 : 0.0; });
}

template <class T>
Tensor tensor(const std::vector<T>& values, const Shape& shape, TensorOptions options) {
  for (int64_t s : shape) ZG_CHECK(s >= 0, "tensor: negative size in shape ", shape_str(shape));
  ZG_CHECK(numel(shape) == static_cast<int64_t>(values.size()), "tensor: ", values.size(),
           " values do not fill shape ", shape_str(shape));
  Tensor host = Tensor::empty(shape, dtype_of<T>());
  std::copy(values.begin(), values.end(), host.data<T>());  // element-wise: std::vector<bool> is packed
  return host.to(options.dtype()).to(options.device());
}

#define ZG_INSTANTIATE(T)                                                                \
  template Tensor tensor<T>(const std::vector<T>&, const Shape&, TensorOptions);         \
  template std::vector<T> Tensor::to_vector<T>() const;                                  \
  template T Tensor::item<T>() const;
ZG_INSTANTIATE(double)
ZG_INSTANTIATE(float)
ZG_INSTANTIATE(Half)
ZG_INSTANTIATE(BFloat16)
ZG_INSTANTIATE(int64_t)
ZG_INSTANTIATE(int32_t)
ZG_INSTANTIATE(bool)
#undef ZG_INSTANTIATE

static Tensor random(const Shape& shape, RandomSpec spec, TensorOptions options, const char* op) {
  ZG_CHECK(is_floating(options.dtype()), op, ": expected a floating-point dtype, got ", name(options.dtype()));
  Generator& generator = Generator::current();
  spec.seed = generator.seed();
  if (DeferredInit::is_active()) {
    new_tensor_bytes(shape, options.dtype());  // a bad shape throws before the generator moves, as below
    spec.first_block = generator.reserve(numel(shape));
    return deferred_tensor(shape, options, recipe(InitRecipe::Kind::random, options.dtype(), 0, spec));
  }
  Tensor out = Tensor::empty(shape, options);
  spec.first_block = generator.reserve(out.numel());
  backend(out.device()).fill_random(out, spec);
  return out;
}

Tensor rand(const Shape& shape, TensorOptions options) { return uniform(shape, 0.0, 1.0, options); }
Tensor randn(const Shape& shape, TensorOptions options) { return normal(shape, 0.0, 1.0, options); }
Tensor uniform(const Shape& shape, double low, double high, TensorOptions options) {
  // high - low scales every draw: an infinite range (or bound) would give inf - inf = NaN.
  ZG_CHECK(std::isfinite(low) && std::isfinite(high) && low <= high && std::isfinite(high - low),
           "uniform: needs finite low <= high whose difference is finite, got low ", low, " and high ", high);
  return random(shape, {Distribution::uniform, low, high}, options, "uniform");
}
Tensor normal(const Shape& shape, double mean, double std, TensorOptions options) {
  ZG_CHECK(std::isfinite(mean) && std::isfinite(std) && std >= 0, "normal: needs a finite mean and a finite std >= 0, got mean ",
           mean, " and std ", std);
  return random(shape, {Distribution::normal, mean, std}, options, "normal");
}

// floor(u (high - low)) + low, u ~ U[0, 1) a multiple of 2^-24: exact in f64 and below high - low.
Tensor randint(int64_t low, int64_t high, const Shape& shape, TensorOptions options) {
  constexpr int64_t kMaxRange = int64_t{1} << 24;
  ZG_CHECK(low < high && high - low <= kMaxRange, "randint: expected low < high with high - low <= 2^24, got low ",
           low, " and high ", high);
  ZG_CHECK(options.dtype() != DType::boolean && detail::holds(options.dtype(), static_cast<double>(low)) &&
               detail::holds(options.dtype(), static_cast<double>(high - 1)),
           "randint: the values from ", low, " to ", high - 1, " do not fit ", name(options.dtype()));
  const Tensor draws = uniform(shape, 0.0, static_cast<double>(high - low), TensorOptions(DType::f64).device(options.device()));
  Tensor out = draws.to(DType::i64);  // truncation: the floor of a non-negative value
  if (low != 0) out.add_(full({}, static_cast<double>(low), TensorOptions(DType::i64).device(options.device())));
  return out.to(options.dtype());
}

Tensor rand_like(const Tensor& t) { return rand(t.shape(), options_of(t)); }
Tensor randn_like(const Tensor& t) { return randn(t.shape(), options_of(t)); }

}  // namespace zg
