#include "tensor/backend.h"

#include <array>
#include <cstdint>
#include <utility>

namespace zg {

Backend& cpu_backend();   // tensor/cpu/backend.cpp
Backend& meta_backend();  // tensor/meta/backend.cpp

bool is_comparison(BinaryOp op) { return op >= BinaryOp::eq && op <= BinaryOp::ge; }
bool is_logical(BinaryOp op) { return op == BinaryOp::logical_and || op == BinaryOp::logical_or; }

namespace {
// Written only while the library loads (static registration), read-only after.
std::array<Backend*, 3>& registry() {
  static std::array<Backend*, 3> backends{&cpu_backend(), nullptr, &meta_backend()};
  return backends;
}
PinnedAllocatorFactory& pinned_factory() {
  static PinnedAllocatorFactory make = nullptr;
  return make;
}
}  // namespace

void register_backend(DeviceType type, Backend* backend) { registry()[static_cast<int>(type)] = backend; }
void register_pinned_allocator(PinnedAllocatorFactory make) { pinned_factory() = make; }
std::shared_ptr<Allocator> make_pinned_allocator() { return pinned_factory() ? pinned_factory()() : nullptr; }

void Backend::attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                 const Tensor&, bool, double, const Tensor&, const Tensor&, const Tensor&) {
  throw Error("attention_backward: this backend has no fused attention (attention() returned false)");
}

// Why flash-attention kernels cannot read `t`, or "": cuDNN's move it with 16-byte vector loads
// (TMA on Hopper), so D must have unit stride and the data and every other stride must
// be 16-byte aligned -- positive multiples of 8 bf16 / f16 elements, nothing broadcast.
// (A size-1 dim's stride addresses nothing and is not looked at.)
std::string flash_attention_unreadable(const Tensor& t, const char* which) {
  // Where the data starts; on the meta device (no data) its place in its storage, whose
  // start every allocator aligns to 16 bytes and more.
  const uintptr_t start = t.data_ptr() != nullptr ? reinterpret_cast<uintptr_t>(t.data_ptr())
                                                  : static_cast<uintptr_t>(t.offset() * t.element_size());
  bool ok = t.strides()[3] == 1 && start % 16 == 0;
  for (int64_t d = 0; d < 3; ++d) ok = ok && (t.size(d) == 1 || (t.strides()[d] > 0 && t.strides()[d] % 8 == 0));
  if (ok) return "";
  return concat(which, " ", describe(t), " with strides ", shape_str(t.strides()), " at ", t.data_ptr(),
                " is not a layout cuDNN's attention kernels read: they need unit stride in D, other strides "
                "positive multiples of 8 elements and 16-byte aligned data");
}

// cuDNN's SDPA takes bf16 or f16, q, k, v of one batch and head count (no
// broadcasting) and one head size D, a multiple of 8 up to 256 (some GPUs stop at 128,
// which cuDNN says when building).
std::string flash_attention_unsupported(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out) {
  const DType dtype = q.dtype();
  if (dtype != DType::bf16 && dtype != DType::f16)
    return concat("cuDNN's fused attention takes bf16 or f16, not ", name(dtype));
  if (k.dtype() != dtype || v.dtype() != dtype) return concat("q, k, v differ in dtype: ", describe(q), ", ",
                                                              describe(k), ", ", describe(v));
  const int64_t head = q.size(3);
  if (k.size(0) != q.size(0) || v.size(0) != q.size(0) || k.size(1) != q.size(1) || v.size(1) != q.size(1) ||
      v.size(3) != head)
    return concat("q ", describe(q), ", k ", describe(k), " and v ", describe(v),
                  " do not share batch, heads and head size (the fused kernels do not broadcast)");
  if (q.numel() == 0 || k.numel() == 0) return concat("empty attention: q ", describe(q), ", k ", describe(k));
  if (head % 8 != 0 || head > 256)
    return concat("head size ", head, ": cuDNN's fused attention takes multiples of 8 up to 256");
  const std::pair<const Tensor*, const char*> operands[] = {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}};
  for (const auto& [t, which] : operands)
    if (std::string why = flash_attention_unreadable(*t, which); !why.empty()) return why;
  return "";
}

// Size-1 dims' strides address nothing and are not looked at.
bool packed_qkv(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (q.dim() != 4 || k.shape() != q.shape() || v.shape() != q.shape() || k.dtype() != q.dtype() ||
      v.dtype() != q.dtype() || k.storage() != q.storage() || v.storage() != q.storage())
    return false;
  const int64_t time = q.size(2), head = q.size(3), channels = q.size(1) * head;
  const int64_t packed[4] = {time * 3 * channels, head, 3 * channels, 1};  // [B, T, 3, H, D] seen as [B, H, T, D]
  for (const Tensor* t : {&q, &k, &v})
    for (int64_t d = 0; d < 4; ++d)
      if (t->size(d) != 1 && t->strides()[d] != packed[d]) return false;
  return k.offset() == q.offset() + channels && v.offset() == q.offset() + 2 * channels;
}

// pre = x W^T (+ bias broadcast over rows), written in place; out = act(pre).
void Backend::linear(const Tensor& x, const Tensor& weight, const Tensor& bias, Activation act, const Tensor& out,
                     const Tensor& pre) {
  const Tensor& target = act == Activation::none ? out : pre;
  const int64_t rows = x.size(0), features = weight.size(0);
  matmul(x.unsqueeze(0), weight.t().unsqueeze(0), target.unsqueeze(0));
  if (bias.defined()) binary(BinaryOp::add, target, bias.unsqueeze(0).expand({rows, features}), target);
  if (act == Activation::gelu) unary(UnaryOp::gelu, pre, out);
}

void Backend::add_layer_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
                             double eps, const Tensor& sum, const Tensor& out, const Tensor& mean, const Tensor& rstd) {
  binary(BinaryOp::add, x, residual, sum);
  layer_norm(sum, weight, bias, eps, out, mean, rstd);
}

// grad_weight = grad^T x (grad^T is a column-major view, which matmul takes as it is);
// grad_bias = the rows of grad^T (a contiguous copy) summed.
void Backend::linear_weight_grad(const Tensor& grad, const Tensor& x, const Tensor& grad_weight,
                                 const Tensor& grad_bias) {
  const int64_t rows = x.size(0), features = grad.size(1);
  matmul(grad.t().unsqueeze(0), x.unsqueeze(0), grad_weight.unsqueeze(0));
  if (!grad_bias.defined()) return;
  const Tensor columns = Tensor::empty({features, rows}, TensorOptions(grad.dtype()).device(grad.device()));
  copy(grad.t(), columns);
  reduce(ReduceOp::sum, columns, grad_bias);
}

Backend& backend(Device device) {
  Backend* b = registry()[static_cast<int>(device.type)];
  ZG_CHECK(b != nullptr, "device ", device.str(), ": this build of zerograd has no CUDA backend");
  return *b;
}

void check_adamw_arguments(const Tensor& master, const Tensor& grad, const Tensor& m, const Tensor& v,
                           const Tensor& compute, const AdamWStep& step) {
  const int64_t n = master.numel();
  const bool has_compute = compute.defined() && !compute.is_same(master);
  for (const Tensor* t : {&master, &grad, &m, &v, &compute}) {
    if (t == &compute && !has_compute) continue;
    ZG_CHECK(t->is_contiguous() && t->numel() == n && t->device() == master.device(),
             "adamw: every span must be contiguous with ", n, " elements on ", master.device().str(),
             " like the master ", describe(master), ", got ", describe(*t));
  }
  ZG_CHECK(m.dtype() == master.dtype() && v.dtype() == master.dtype(), "adamw: m and v must have the master's dtype ",
           describe(master), ", got ", describe(m), " and ", describe(v));
  const Tensor& scale = step.device_scale;
  ZG_CHECK(!scale.defined() ||
               (scale.numel() == 1 && scale.dtype() == master.dtype() && scale.device() == master.device()),
           "adamw: device_scale must be one element of the master's dtype on its device, like ", describe(master),
           ", got ", describe(scale));
}

QuantBlocks check_quantize_arguments(const char* op, const Tensor& values, const Tensor& q, const Tensor& scales,
                                     int bits, int64_t block, int64_t segment) {
  ZG_CHECK(bits == 8 || bits == 4, op, ": quantizes to 8 or 4 bits, not ", bits);
  ZG_CHECK(block > 0 && (bits == 8 || block % 2 == 0), op, ": the block must be positive", bits == 4 ? " and even at 4 bits" : "",
           ", got ", block);
  const int64_t n = values.numel();
  ZG_CHECK(segment > 0 && n % segment == 0 && (bits == 8 || segment % 2 == 0), op,
           ": the segment (where blocks restart) must be positive", bits == 4 ? ", even at 4 bits," : "",
           " and divide the ", n, " elements, got ", segment);
  const QuantBlocks layout{n, block, segment, bits};
  const int64_t blocks = layout.count();
  ZG_CHECK(is_floating(values.dtype()) && values.is_contiguous() && values.dim() == 1, op,
           ": the values must be a contiguous 1-D floating tensor, got ", describe(values));
  ZG_CHECK(q.dtype() == DType::i8 && q.is_contiguous() && q.dim() == 1 && q.numel() == layout.bytes() &&
               q.device() == values.device(),
           op, ": the quantized values must be a contiguous [", layout.bytes(), "] i8 tensor (", bits,
           " bits an element) on ", values.device().str(), ", got ", describe(q));
  ZG_CHECK(scales.dtype() == DType::f32 && scales.is_contiguous() && scales.dim() == 1 && scales.numel() == blocks &&
               scales.device() == values.device(),
           op, ": the scales must be a contiguous [", blocks, "] f32 tensor (one per block of ", block, ") on ",
           values.device().str(), ", got ", describe(scales));
  return layout;
}

}  // namespace zg
