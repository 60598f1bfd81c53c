// Tensor: a refcounted handle to (storage, offset, shape, strides, dtype).
// Copying a Tensor copies the handle; views share the storage, so writing
// through a view changes the base.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "tensor/device.h"
#include "tensor/dtype.h"
#include "tensor/error.h"
#include "tensor/shape.h"
#include "tensor/storage.h"

namespace zg {

// dtype and device for a new tensor; implicit from either, chainable like libtorch:
//   zeros({2, 3}, f64)   zeros({2, 3}, kMeta)   zeros({2, 3}, TensorOptions(bf16).device(kMeta))
class TensorOptions {
 public:
  TensorOptions() = default;
  TensorOptions(DType dtype) : dtype_(dtype) {}     // NOLINT: implicit
  TensorOptions(Device device) : device_(device) {}  // NOLINT: implicit
  TensorOptions dtype(DType dtype) const { TensorOptions o = *this; o.dtype_ = dtype; return o; }
  TensorOptions device(Device device) const { TensorOptions o = *this; o.device_ = device; return o; }
  // From the rank's host pool (Context::host_allocator): page-locked where a GPU is
  // present, and counted apart from other host memory (host_memory_stats). Offloaded
  // optimizer state lives there. For cpu tensors (meta: a dry run's host bytes).
  TensorOptions pinned(bool pinned = true) const { TensorOptions o = *this; o.pinned_ = pinned; return o; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  bool is_pinned() const { return pinned_; }

 private:
  DType dtype_ = DType::f32;
  Device device_ = kCPU;
  bool pinned_ = false;
};

struct AutogradMeta;  // autograd/graph.h; a tensor only points to it
class ParameterOwner;
class Node;

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  int64_t offset = 0;  // in elements
  Shape shape;
  Shape strides;  // in elements; 0 for broadcast (expanded) dims
  DType dtype = DType::f32;
  std::shared_ptr<AutogradMeta> autograd;  // null until the tensor takes part in autograd
};

class Tensor {
 public:
  Tensor() = default;  // undefined: holds nothing
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // New contiguous tensor from the current context's allocator for `options.device()`,
  // tagged with the current MemoryScope category. Contents are undefined.
  static Tensor empty(const Shape& shape, TensorOptions options = {});
  // Its storage starts released (tensor/storage.h): nothing is allocated until it is
  // materialised, in the memory category current now.
  static Tensor empty_released(const Shape& shape, TensorOptions options = {});

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl().shape; }
  const Shape& strides() const { return impl().strides; }
  int64_t size(int64_t dim) const;
  int64_t dim() const { return static_cast<int64_t>(impl().shape.size()); }
  int64_t numel() const { return zg::numel(impl().shape); }
  int64_t offset() const { return impl().offset; }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().storage->device(); }
  int64_t element_size() const { return zg::element_size(dtype()); }
  int64_t nbytes() const;  // throws where a (broadcast) view spans more bytes than an int64 counts
  bool is_contiguous() const;
  bool is_same(const Tensor& other) const { return impl_ == other.impl_; }
  // How many Tensor handles share this one (as at::Tensor::use_count); views are other tensors.
  int64_t use_count() const { return impl_.use_count(); }
  const std::shared_ptr<Storage>& storage() const { return impl().storage; }
  TensorImpl& impl() const;
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

  // Pointer to element 0, read from the storage now (throws if it was released).
  void* data_ptr() const;
  template <class T>
  T* data() const {
    ZG_CHECK(dtype_of<T>() == dtype(), "data: tensor is ", name(dtype()), ", asked for ", name(dtype_of<T>()));
    return static_cast<T*>(data_ptr());
  }

  // ---- views: share storage, no copy (autograd/tensor_methods.cpp, with their gradients) ----
  Tensor view(const Shape& shape) const;       // -1 infers one size; throws if strides forbid it
  Tensor reshape(const Shape& shape) const;    // view when possible, else a contiguous copy
  Tensor permute(const Shape& dims) const;
  Tensor transpose(int64_t dim0, int64_t dim1) const;
  Tensor t() const;                            // transpose of the last two dims
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;  // Python-style clamped range
  Tensor select(int64_t dim, int64_t index) const;  // removes `dim`
  Tensor expand(const Shape& shape) const;     // size-1 dims broadcast with stride 0; -1 keeps a size
  Tensor squeeze() const;                      // all size-1 dims
  Tensor squeeze(int64_t dim) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor flatten() const { return reshape({-1}); }
  Tensor contiguous() const;                   // itself when already contiguous

  // ---- copies and conversions (autograd/tensor_methods.cpp: in-place writes check grad mode) ----
  Tensor to(Device device) const;  // itself when already there
  Tensor to(DType dtype) const;    // itself when already that dtype
  Tensor clone() const;
  Tensor& copy_(const Tensor& src);  // broadcasts src into this, casting dtype and crossing devices
  Tensor& fill_(double value);
  Tensor& zero_() { return fill_(0.0); }
  Tensor& add_(const Tensor& other, double alpha = 1.0);  // this += alpha * other (other broadcasts)
  Tensor& mul_(double factor);

  // The single element as T (an element type of a dtype: float, double, int64_t, ...).
  template <class T>
  T item() const;
  // All elements in row-major order, converted to T.
  template <class T>
  std::vector<T> to_vector() const;

  std::string str() const;  // as PyTorch prints: tensor([[1., 2.], ...])

  // ---- autograd (autograd/graph.cpp; the engine is autograd/engine.cpp) ----
  bool requires_grad() const;
  Tensor& set_requires_grad(bool requires_grad = true);  // leaves only
  bool is_leaf() const;                                  // made by the user, not by a recorded op
  // Undefined until a backward reaches it. A handle (by value) like every Tensor: in-place
  // methods write the gradient itself, so p.grad().zero_() zeroes p's .grad.
  Tensor grad() const;
  // A non-leaf keeps the gradient that reaches it in .grad from now on, summed over
  // backward calls (PyTorch's retain_grad); a leaf keeps its gradient anyway.
  void retain_grad() const;
  bool retains_grad() const;
  void set_grad(const Tensor& grad) const;                   // e.g. a view into a flat gradient buffer
  std::shared_ptr<Node> grad_fn() const;
  Tensor detach() const;                                 // same storage, no history
  // Accumulates d(this)/d(leaf) into every leaf's .grad. `grad` defaults to 1 for one element.
  void backward(const Tensor& grad = Tensor(), bool retain_graph = false) const;
  // fn(grad) runs when this tensor's gradient is computed; a defined result replaces it.
  void register_hook(std::function<Tensor(const Tensor&)> fn) const;
  // Leaves: fn(leaf) runs after the gradient was accumulated into leaf.grad().
  void register_post_accumulate_grad_hook(std::function<void(const Tensor&)> fn) const;
  // Shares `source`'s storage, offset, shape, strides and dtype (param.data = ... in PyTorch),
  // keeping autograd state; .grad is dropped if the shape, dtype or device changed.
  // Both refuse a parameter that lives in a ShardedModel's flat
  // buffers (ParameterOwner, autograd/graph.h).
  void set_data(const Tensor& source) const;

 private:
  friend class ParameterOwner;  // repoints its own parameters
  void set_grad_unchecked(const Tensor& grad) const;
  void set_data_unchecked(const Tensor& source) const;
  std::shared_ptr<TensorImpl> impl_;
};

// Every in-place write (copy_, fill_, a collective's output...) starts here: it refuses
// a tensor that requires grad while grad mode is on (the write would silently corrupt
// its gradient) and bumps the storage version, so a SavedTensor of it fails loudly.
// Defined with the in-place methods (autograd/tensor_methods.cpp), as it reads grad mode.
void begin_inplace(const Tensor& t, const char* op);

std::ostream& operator<<(std::ostream& os, const Tensor& t);
// "f32[2, 3] on cpu": how error messages name a tensor.
std::string describe(const Tensor& t);
// The elements [first, last) of its storage that a view with elements reaches (strides
// are never negative). Two views of one storage (which share its dtype) whose ranges
// are disjoint share no element.
std::pair<int64_t, int64_t> storage_range(const Tensor& t);

// ---- factories ----
Tensor empty(const Shape& shape, TensorOptions options = {});
Tensor zeros(const Shape& shape, TensorOptions options = {});
Tensor ones(const Shape& shape, TensorOptions options = {});
Tensor full(const Shape& shape, double value, TensorOptions options = {});
Tensor empty_like(const Tensor& t);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor full_like(const Tensor& t, double value);
// [start, end) in steps of `step`, like torch.arange; defaults to i64.
Tensor arange(int64_t end, TensorOptions options = DType::i64);
Tensor arange(double start, double end, double step = 1.0, TensorOptions options = DType::i64);
// `steps` values evenly spaced from start to end, both included, as torch.linspace (each
// half counted from its own end, so the last value is `end` exactly).
Tensor linspace(double start, double end, int64_t steps, TensorOptions options = {});
// [n, m] (m = n when negative) with ones on the diagonal, as torch.eye.
Tensor eye(int64_t n, int64_t m = -1, TensorOptions options = {});

// From host data (copied). The dtype defaults to T's; options may ask for another and a device.
template <class T>
Tensor tensor(const std::vector<T>& values, const Shape& shape, TensorOptions options);
template <class T>
Tensor tensor(const std::vector<T>& values, const Shape& shape) {
  return tensor(values, shape, TensorOptions(dtype_of<T>()));
}
template <class T>
Tensor tensor(const std::vector<T>& values) {
  return tensor(values, Shape{static_cast<int64_t>(values.size())});
}

// Random tensors from the current context's Philox generator.
Tensor rand(const Shape& shape, TensorOptions options = {});   // U[0, 1)
Tensor randn(const Shape& shape, TensorOptions options = {});  // N(0, 1)
Tensor uniform(const Shape& shape, double low, double high, TensorOptions options = {});
Tensor normal(const Shape& shape, double mean, double std, TensorOptions options = {});
// Integers drawn uniformly from [low, high), as torch.randint; defaults to i64. From one
// U[0, 1) draw an element (24 random bits), so high - low is at most 2^24.
Tensor randint(int64_t low, int64_t high, const Shape& shape, TensorOptions options = DType::i64);
// rand / randn of t's shape, dtype and device.
Tensor rand_like(const Tensor& t);
Tensor randn_like(const Tensor& t);

}  // namespace zg
