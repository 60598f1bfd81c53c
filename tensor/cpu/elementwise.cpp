// Elementwise kernels. Each op is a small lambda applied in the compute type
// (f32 for f16/bf16); the op is chosen once, outside the element loop. GELU and its
// backward on contiguous f32 take a vectorised path of their own (vectorized.inc).
#include <algorithm>
#include <cmath>

#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/loops.h"
#include "tensor/cpu/vectorized.h"

namespace zg::cpu {

namespace {

// Calls body(fn) with fn the scalar function of a floating-point unary op.
template <class Body>
void with_float_unary(UnaryOp op, Body&& body) {
  switch (op) {
    case UnaryOp::neg: return body([](auto x) { return -x; });
    case UnaryOp::abs: return body([](auto x) { return std::abs(x); });
    case UnaryOp::exp: return body([](auto x) { return std::exp(x); });
    case UnaryOp::log: return body([](auto x) { return std::log(x); });
    case UnaryOp::sqrt: return body([](auto x) { return std::sqrt(x); });
    case UnaryOp::rsqrt: return body([](auto x) { return decltype(x)(1) / std::sqrt(x); });
    case UnaryOp::sin: return body([](auto x) { return std::sin(x); });
    case UnaryOp::cos: return body([](auto x) { return std::cos(x); });
    case UnaryOp::tanh: return body([](auto x) { return std::tanh(x); });
    case UnaryOp::sigmoid: return body([](auto x) { return decltype(x)(1) / (decltype(x)(1) + std::exp(-x)); });
    // NaN passes through (!(NaN <= 0)), as in PyTorch: a NaN activation stays visible.
    case UnaryOp::relu: return body([](auto x) { return !(x <= decltype(x)(0)) ? x : decltype(x)(0); });
    case UnaryOp::gelu:
      // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
      return body([](auto x) {
        using C = decltype(x);
        const C k = C(0.7978845608028654);
        return C(0.5) * x * (C(1) + std::tanh(k * (x + C(0.044715) * x * x * x)));
      });
    case UnaryOp::erf: return body([](auto x) { return std::erf(x); });
    case UnaryOp::log1p: return body([](auto x) { return std::log1p(x); });
    case UnaryOp::logical_not: break;
  }
  fail("unary: op ", static_cast<int>(op), " is not defined for floating-point tensors");
}

template <class Body>
void with_integer_unary(UnaryOp op, Body&& body) {
  switch (op) {
    case UnaryOp::neg: return body([](auto x) { return wrapping_neg(x); });  // wraps, as on the GPU
    case UnaryOp::abs: return body([](auto x) { return x < 0 ? wrapping_neg(x) : x; });
    case UnaryOp::relu: return body([](auto x) { return x > 0 ? x : decltype(x)(0); });
    default: break;
  }
  fail("unary: op ", static_cast<int>(op), " is not defined for integer tensors");
}

template <class Body>
void with_arithmetic(BinaryOp op, Body&& body) {
  switch (op) {
    // Integers wrap around, as on the GPU (tensor/int_math.h); floats are plain + - *.
    case BinaryOp::add: return body([](auto a, auto b) { return wrapping_add(a, b); });
    case BinaryOp::sub: return body([](auto a, auto b) { return wrapping_sub(a, b); });
    case BinaryOp::mul: return body([](auto a, auto b) { return wrapping_mul(a, b); });
    case BinaryOp::div: return body([](auto a, auto b) { return a / b; });
    case BinaryOp::pow: return body([](auto a, auto b) { return static_cast<decltype(a)>(std::pow(a, b)); });
    // NaN wins, as in torch.maximum / torch.minimum.
    case BinaryOp::maximum: return body([](auto a, auto b) { return (a != a || a > b) ? a : b; });
    case BinaryOp::minimum: return body([](auto a, auto b) { return (a != a || a < b) ? a : b; });
    // a = x, b = g:  g (0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) k (1 + 3 c x^2)),  u = k (x + c x^3)
    case BinaryOp::gelu_backward:
      return body([](auto x, auto g) {
        using C = decltype(x);
        const C k = C(0.7978845608028654), c = C(0.044715);
        const C t = std::tanh(k * (x + c * x * x * x));
        return g * (C(0.5) * (C(1) + t) + C(0.5) * x * (C(1) - t * t) * k * (C(1) + C(3) * c * x * x));
      });
    default: break;
  }
  fail("binary: op ", static_cast<int>(op), " is not arithmetic");
}

template <class Body>
void with_predicate(BinaryOp op, Body&& body) {
  switch (op) {
    case BinaryOp::eq: return body([](auto a, auto b) { return a == b; });
    case BinaryOp::ne: return body([](auto a, auto b) { return a != b; });
    case BinaryOp::lt: return body([](auto a, auto b) { return a < b; });
    case BinaryOp::le: return body([](auto a, auto b) { return a <= b; });
    case BinaryOp::gt: return body([](auto a, auto b) { return a > b; });
    case BinaryOp::ge: return body([](auto a, auto b) { return a >= b; });
    case BinaryOp::logical_and: return body([](auto a, auto b) { return a && b; });
    case BinaryOp::logical_or: return body([](auto a, auto b) { return a || b; });
    default: break;
  }
  fail("binary: op ", static_cast<int>(op), " is not a predicate");
}

// out[i] = fn(x[i]) in the compute type of T.
template <class T, class Out, class Fn>
void map_unary(const Tensor& in, const Tensor& out, Fn fn) {
  const T* x = static_cast<const T*>(in.data_ptr());
  Out* y = static_cast<Out*>(out.data_ptr());
  for_each_element<2>(out.shape(), {&out.strides(), &in.strides()},
                      [&](const auto& off) { y[off[0]] = Out(fn(compute_t<T>(x[off[1]]))); });
}

template <class T, class Out, class Fn>
void map_binary(const Tensor& a, const Tensor& b, const Tensor& out, Fn fn) {
  const T* x = static_cast<const T*>(a.data_ptr());
  const T* z = static_cast<const T*>(b.data_ptr());
  Out* y = static_cast<Out*>(out.data_ptr());
  for_each_element<3>(out.shape(), {&out.strides(), &a.strides(), &b.strides()}, [&](const auto& off) {
    y[off[0]] = Out(fn(compute_t<T>(x[off[1]]), compute_t<T>(z[off[2]])));
  });
}

bool contiguous_f32(std::initializer_list<const Tensor*> tensors, int64_t numel) {
  for (const Tensor* t : tensors)
    if (t->dtype() != DType::f32 || !t->is_contiguous() || t->numel() != numel) return false;
  return true;
}


}  // namespace

void CpuBackend::unary(UnaryOp op, const Tensor& in, const Tensor& out) {
  if (op == UnaryOp::gelu && contiguous_f32({&in, &out}, out.numel()))
    return vector_kernels().gelu_f32(in, nullptr, out);
  dispatch(in.dtype(), [&]<class T>() {
    if constexpr (std::is_same_v<T, bool>) {
      map_unary<T, T>(in, out, [](bool x) { return !x; });
    } else if constexpr (is_float_v<T>) {
      with_float_unary(op, [&](auto fn) { map_unary<T, T>(in, out, fn); });
    } else {
      with_integer_unary(op, [&](auto fn) { map_unary<T, T>(in, out, fn); });
    }
  });
}

void CpuBackend::binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  if (op == BinaryOp::gelu_backward && contiguous_f32({&a, &b, &out}, out.numel()))
    return vector_kernels().gelu_f32(a, &b, out);
  dispatch(a.dtype(), [&]<class T>() {
    if (is_comparison(op) || is_logical(op)) {
      with_predicate(op, [&](auto fn) { map_binary<T, bool>(a, b, out, fn); });
    } else if constexpr (!std::is_same_v<T, bool>) {
      with_arithmetic(op, [&](auto fn) { map_binary<T, T>(a, b, out, fn); });
    } else {
      fail("binary: arithmetic is not defined for bool tensors");
    }
  });
}

void CpuBackend::where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  dispatch(a.dtype(), [&]<class T>() {
    const bool* c = cond.data<bool>();
    const T* x = a.data<T>();
    const T* z = b.data<T>();
    T* y = out.data<T>();
    for_each_element<4>(out.shape(), {&out.strides(), &cond.strides(), &a.strides(), &b.strides()},
                        [&](const auto& off) { y[off[0]] = c[off[1]] ? x[off[2]] : z[off[3]]; });
  });
}

}  // namespace zg::cpu
