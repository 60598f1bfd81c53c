// Elementwise front-ends. Broadcasting is a view: inputs are expanded to the
// output's shape (stride 0 where broadcast), so kernels only see equal shapes.
#include "tensor/backend.h"
#include "tensor/ops.h"
#include "tensor/ops/checks.h"

namespace zg {

using detail::check_compatible;
using detail::check_defined;
using detail::options_of;
using detail::scalar_like;

namespace {

Tensor unary(UnaryOp op, const Tensor& x, const char* name) {
  check_defined(name, x);
  if (op == UnaryOp::logical_not) {
    ZG_CHECK(x.dtype() == DType::boolean, name, ": expected a bool tensor, got ", describe(x));
  } else if (op == UnaryOp::neg || op == UnaryOp::abs || op == UnaryOp::relu) {
    ZG_CHECK(x.dtype() != DType::boolean, name, ": not defined for bool tensors, got ", describe(x));
  } else {
    detail::check_floating(name, x);
  }
  Tensor out = empty_like(x);
  backend(x.device()).unary(op, x, out);
  return out;
}

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b, const char* name) {
  check_compatible(name, a, b);
  if (is_logical(op)) {
    ZG_CHECK(a.dtype() == DType::boolean, name, ": expected bool tensors, got ", describe(a), " and ", describe(b));
  } else if (op == BinaryOp::div || op == BinaryOp::pow) {
    detail::check_floating(name, a);
  } else if (!is_comparison(op)) {
    ZG_CHECK(a.dtype() != DType::boolean, name, ": not defined for bool tensors, got ", describe(a), " and ",
             describe(b));
  }
  const Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  const DType dtype = is_comparison(op) ? DType::boolean : a.dtype();
  Tensor out = empty(shape, TensorOptions(dtype).device(a.device()));
  backend(a.device()).binary(op, a.expand(shape), b.expand(shape), out);
  return out;
}

}  // namespace

Tensor neg(const Tensor& x) { return unary(UnaryOp::neg, x, "neg"); }
Tensor abs(const Tensor& x) { return unary(UnaryOp::abs, x, "abs"); }
Tensor exp(const Tensor& x) { return unary(UnaryOp::exp, x, "exp"); }
Tensor log(const Tensor& x) { return unary(UnaryOp::log, x, "log"); }
Tensor sqrt(const Tensor& x) { return unary(UnaryOp::sqrt, x, "sqrt"); }
Tensor rsqrt(const Tensor& x) { return unary(UnaryOp::rsqrt, x, "rsqrt"); }
Tensor sin(const Tensor& x) { return unary(UnaryOp::sin, x, "sin"); }
Tensor cos(const Tensor& x) { return unary(UnaryOp::cos, x, "cos"); }
Tensor tanh(const Tensor& x) { return unary(UnaryOp::tanh, x, "tanh"); }
Tensor sigmoid(const Tensor& x) { return unary(UnaryOp::sigmoid, x, "sigmoid"); }
Tensor relu(const Tensor& x) { return unary(UnaryOp::relu, x, "relu"); }
Tensor gelu(const Tensor& x) { return unary(UnaryOp::gelu, x, "gelu"); }
Tensor logical_not(const Tensor& x) { return unary(UnaryOp::logical_not, x, "logical_not"); }

// Each binary op with a tensor and with a scalar right-hand side.
#define ZG_BINARY(fn, OP)                                                                        \
  Tensor fn(const Tensor& a, const Tensor& b) { return binary(BinaryOp::OP, a, b, #fn); }        \
  Tensor fn(const Tensor& a, double b) {                                                         \
    check_defined(#fn, a);                                                                       \
    return binary(BinaryOp::OP, a, scalar_like(a, b), #fn);                                      \
  }
ZG_BINARY(add, add)
ZG_BINARY(sub, sub)
ZG_BINARY(mul, mul)
ZG_BINARY(div, div)
ZG_BINARY(pow, pow)
ZG_BINARY(maximum, maximum)
ZG_BINARY(minimum, minimum)
ZG_BINARY(eq, eq)
ZG_BINARY(ne, ne)
ZG_BINARY(lt, lt)
ZG_BINARY(le, le)
ZG_BINARY(gt, gt)
ZG_BINARY(ge, ge)
#undef ZG_BINARY

Tensor logical_and(const Tensor& a, const Tensor& b) { return binary(BinaryOp::logical_and, a, b, "logical_and"); }
Tensor logical_or(const Tensor& a, const Tensor& b) { return binary(BinaryOp::logical_or, a, b, "logical_or"); }

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  check_defined("where", cond);
  check_compatible("where", a, b);
  ZG_CHECK(cond.dtype() == DType::boolean, "where: expected a bool condition, got ", describe(cond));
  ZG_CHECK(cond.device() == a.device(), "where: device mismatch: ", describe(cond), " and ", describe(a));
  const Shape shape = broadcast_shapes(broadcast_shapes(cond.shape(), a.shape(), "where"), b.shape(), "where");
  Tensor out = empty(shape, options_of(a));
  backend(a.device()).where(cond.expand(shape), a.expand(shape), b.expand(shape), out);
  return out;
}

Tensor where(const Tensor& cond, double a, const Tensor& b) {
  check_defined("where", b);
  return where(cond, scalar_like(b, a), b);
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  check_defined("masked_fill", x);
  check_defined("masked_fill", mask);
  ZG_CHECK(broadcast_shapes(mask.shape(), x.shape(), "masked_fill") == x.shape(), "masked_fill: mask shape ",
           shape_str(mask.shape()), " does not broadcast to the tensor's shape ", shape_str(x.shape()));
  return where(mask, value, x);
}

Tensor operator-(const Tensor& x) { return neg(x); }
Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator+(const Tensor& a, double b) { return add(a, b); }
Tensor operator-(const Tensor& a, double b) { return sub(a, b); }
Tensor operator*(const Tensor& a, double b) { return mul(a, b); }
Tensor operator/(const Tensor& a, double b) { return div(a, b); }
Tensor operator+(double a, const Tensor& b) { return add(b, a); }
Tensor operator-(double a, const Tensor& b) { check_defined("sub", b); return sub(scalar_like(b, a), b); }
Tensor operator*(double a, const Tensor& b) { return mul(b, a); }
Tensor operator/(double a, const Tensor& b) { check_defined("div", b); return div(scalar_like(b, a), b); }

}  // namespace zg
