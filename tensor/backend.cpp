#include "tensor/backend.h"

#include <array>

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
}  // namespace

void register_backend(DeviceType type, Backend* backend) { registry()[static_cast<int>(type)] = backend; }

void Backend::attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                 const Tensor&, bool, double, const Tensor&, const Tensor&, const Tensor&) {
  throw Error("attention_backward: this backend has no fused attention (attention() returned false)");
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

}  // namespace zg
