// Elementwise kernels: one grid-stride loop per op family, reading every operand
// through its own strides (broadcast inputs have stride 0), computing in the
// compute type (f32 for f16/bf16) and rounding once to the output; dense operands
// take a twin loop with 128-bit loads and no index arithmetic. The op is a
// template parameter, chosen once on the host, as the CPU backend chooses its lambda.
#include "cuda/backend.h"
#include "cuda/kernels.cuh"

namespace zg::cuda {

namespace {

// ---- the scalar functions, in the compute type C ----

template <UnaryOp Op, class C>
__device__ __forceinline__ C apply_unary(C x) {
  if constexpr (Op == UnaryOp::neg) return wrapping_neg(x);  // integers wrap (tensor/int_math.h)
  else if constexpr (Op == UnaryOp::abs) {
    if constexpr (std::is_floating_point_v<C>) return math_abs(x);
    else return x < 0 ? wrapping_neg(x) : x;
  } else if constexpr (Op == UnaryOp::relu) return !(x <= C(0)) ? x : C(0);  // NaN passes through
  else if constexpr (Op == UnaryOp::exp) return math_exp(x);
  else if constexpr (Op == UnaryOp::log) return math_log(x);
  else if constexpr (Op == UnaryOp::sqrt) return math_sqrt(x);
  else if constexpr (Op == UnaryOp::rsqrt) return C(1) / math_sqrt(x);
  else if constexpr (Op == UnaryOp::sin) return math_sin(x);
  else if constexpr (Op == UnaryOp::cos) return math_cos(x);
  else if constexpr (Op == UnaryOp::tanh) return math_tanh(x);
  else if constexpr (Op == UnaryOp::sigmoid) return C(1) / (C(1) + math_exp(-x));
  else if constexpr (Op == UnaryOp::gelu) {
    // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), GPT-2's tanh approximation
    const C k = C(0.7978845608028654);
    const C inner = k * (x + C(0.044715) * x * x * x);
    return C(0.5) * x * (C(1) + math_tanh(inner));
  } else if constexpr (Op == UnaryOp::erf) return math_erf(x);
  else if constexpr (Op == UnaryOp::log1p) return math_log1p(x);
  else return !x;  // logical_not (bool only)
}

template <BinaryOp Op, class C>
__device__ __forceinline__ auto apply_binary(C a, C b) {
  if constexpr (Op == BinaryOp::add) return wrapping_add(a, b);  // integers wrap (tensor/int_math.h)
  else if constexpr (Op == BinaryOp::sub) return wrapping_sub(a, b);
  else if constexpr (Op == BinaryOp::mul) return wrapping_mul(a, b);
  else if constexpr (Op == BinaryOp::div) return a / b;
  else if constexpr (Op == BinaryOp::pow) {
    if constexpr (std::is_same_v<C, float>) return powf(a, b);
    else return static_cast<C>(pow(static_cast<double>(a), static_cast<double>(b)));
  }
  // NaN wins, as in torch.maximum / torch.minimum.
  else if constexpr (Op == BinaryOp::maximum) return (a != a || a > b) ? a : b;
  else if constexpr (Op == BinaryOp::minimum) return (a != a || a < b) ? a : b;
  else if constexpr (Op == BinaryOp::gelu_backward) {
    // a = x, b = g:  g (0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) k (1 + 3 c x^2)),  u = k (x + c x^3)
    const C k = C(0.7978845608028654), c = C(0.044715);
    const C t = math_tanh(k * (a + c * a * a * a));
    return b * (C(0.5) * (C(1) + t) + C(0.5) * a * (C(1) - t * t) * k * (C(1) + C(3) * c * a * a));
  }
  else if constexpr (Op == BinaryOp::eq) return a == b;
  else if constexpr (Op == BinaryOp::ne) return a != b;
  else if constexpr (Op == BinaryOp::lt) return a < b;
  else if constexpr (Op == BinaryOp::le) return a <= b;
  else if constexpr (Op == BinaryOp::gt) return a > b;
  else if constexpr (Op == BinaryOp::ge) return a >= b;
  else if constexpr (Op == BinaryOp::logical_and) return static_cast<bool>(a) && static_cast<bool>(b);
  else return static_cast<bool>(a) || static_cast<bool>(b);  // logical_or
}

// ---- kernels ----

// y[i] = f(x[i])
template <UnaryOp Op, class T>
__global__ void unary_kernel(const T* x, T* y, StridedIndexer<2> ix, int64_t n) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) {
    int64_t off[2];
    ix.offsets(i, off);
    y[off[0]] = convert<T>(apply_unary<Op>(widen(x[off[1]])));
  }
}

// y[i] = f(a[i], b[i]); Out is T for arithmetic, bool for comparisons and logic.
template <BinaryOp Op, class T, class Out>
__global__ void binary_kernel(const T* a, const T* b, Out* y, StridedIndexer<3> ix, int64_t n) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) {
    int64_t off[3];
    ix.offsets(i, off);
    y[off[0]] = convert<Out>(apply_binary<Op>(widen(a[off[1]]), widen(b[off[2]])));
  }
}

// ---- the dense case: 128-bit loads ----
// When every operand is contiguous in the same order (the indexer merged the view to
// one dim of unit strides) and 16-byte aligned, a thread moves a whole 16-byte pack
// of the input per load (Pack, cuda/kernels.cuh) instead of one element, and needs no
// index arithmetic; the last n % V elements go one by one.

template <UnaryOp Op, class T>
__global__ void unary_dense_kernel(const T* x, T* y, int64_t n) {
  constexpr int V = kPack<T>;
  using P = Pack<T, V>;
  const int64_t packs = n / V;
  for (int64_t p = grid_index(); p < packs; p += grid_stride()) {
    const P in = reinterpret_cast<const P*>(x)[p];
    P out;
#pragma unroll
    for (int k = 0; k < V; ++k) out.v[k] = convert<T>(apply_unary<Op>(widen(in.v[k])));
    reinterpret_cast<P*>(y)[p] = out;
  }
  for (int64_t i = packs * V + grid_index(); i < n; i += grid_stride()) y[i] = convert<T>(apply_unary<Op>(widen(x[i])));
}

template <BinaryOp Op, class T, class Out>
__global__ void binary_dense_kernel(const T* a, const T* b, Out* y, int64_t n) {
  constexpr int V = kPack<T>;
  using P = Pack<T, V>;
  using Q = Pack<Out, V>;
  const int64_t packs = n / V;
  for (int64_t p = grid_index(); p < packs; p += grid_stride()) {
    const P left = reinterpret_cast<const P*>(a)[p], right = reinterpret_cast<const P*>(b)[p];
    Q out;
#pragma unroll
    for (int k = 0; k < V; ++k) out.v[k] = convert<Out>(apply_binary<Op>(widen(left.v[k]), widen(right.v[k])));
    reinterpret_cast<Q*>(y)[p] = out;
  }
  for (int64_t i = packs * V + grid_index(); i < n; i += grid_stride())
    y[i] = convert<Out>(apply_binary<Op>(widen(a[i]), widen(b[i])));
}

// Whether the dense kernels apply: one merged dim of unit stride in every operand, and
// every pointer aligned to its pack (a view may start mid-pack).
template <int N>
bool is_dense(const StridedIndexer<N>& ix, std::initializer_list<std::pair<const void*, int>> pointers_and_packs) {
  if (ix.rank > 1) return false;
  for (int j = 0; j < N; ++j)
    if (ix.rank == 1 && ix.strides[j][0] != 1) return false;
  for (const auto& [pointer, pack_bytes] : pointers_and_packs)
    if (reinterpret_cast<uintptr_t>(pointer) % static_cast<uintptr_t>(pack_bytes) != 0) return false;
  return true;
}

// y[i] = cond[i] ? a[i] : b[i]
template <class T>
__global__ void where_kernel(const bool* cond, const T* a, const T* b, T* y, StridedIndexer<4> ix, int64_t n) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) {
    int64_t off[4];
    ix.offsets(i, off);
    y[off[0]] = cond[off[1]] ? a[off[2]] : b[off[3]];
  }
}

// ---- host: runtime op -> template argument ----

template <class Body>
void with_unary(UnaryOp op, Body&& body) {
  switch (op) {
    case UnaryOp::neg: return body.template operator()<UnaryOp::neg>();
    case UnaryOp::abs: return body.template operator()<UnaryOp::abs>();
    case UnaryOp::exp: return body.template operator()<UnaryOp::exp>();
    case UnaryOp::log: return body.template operator()<UnaryOp::log>();
    case UnaryOp::sqrt: return body.template operator()<UnaryOp::sqrt>();
    case UnaryOp::rsqrt: return body.template operator()<UnaryOp::rsqrt>();
    case UnaryOp::sin: return body.template operator()<UnaryOp::sin>();
    case UnaryOp::cos: return body.template operator()<UnaryOp::cos>();
    case UnaryOp::tanh: return body.template operator()<UnaryOp::tanh>();
    case UnaryOp::sigmoid: return body.template operator()<UnaryOp::sigmoid>();
    case UnaryOp::relu: return body.template operator()<UnaryOp::relu>();
    case UnaryOp::gelu: return body.template operator()<UnaryOp::gelu>();
    case UnaryOp::erf: return body.template operator()<UnaryOp::erf>();
    case UnaryOp::log1p: return body.template operator()<UnaryOp::log1p>();
    case UnaryOp::logical_not: return body.template operator()<UnaryOp::logical_not>();
  }
  fail("unary: unknown op ", static_cast<int>(op));
}

template <class Body>
void with_binary(BinaryOp op, Body&& body) {
  switch (op) {
    case BinaryOp::add: return body.template operator()<BinaryOp::add>();
    case BinaryOp::sub: return body.template operator()<BinaryOp::sub>();
    case BinaryOp::mul: return body.template operator()<BinaryOp::mul>();
    case BinaryOp::div: return body.template operator()<BinaryOp::div>();
    case BinaryOp::pow: return body.template operator()<BinaryOp::pow>();
    case BinaryOp::maximum: return body.template operator()<BinaryOp::maximum>();
    case BinaryOp::minimum: return body.template operator()<BinaryOp::minimum>();
    case BinaryOp::gelu_backward: return body.template operator()<BinaryOp::gelu_backward>();
    case BinaryOp::eq: return body.template operator()<BinaryOp::eq>();
    case BinaryOp::ne: return body.template operator()<BinaryOp::ne>();
    case BinaryOp::lt: return body.template operator()<BinaryOp::lt>();
    case BinaryOp::le: return body.template operator()<BinaryOp::le>();
    case BinaryOp::gt: return body.template operator()<BinaryOp::gt>();
    case BinaryOp::ge: return body.template operator()<BinaryOp::ge>();
    case BinaryOp::logical_and: return body.template operator()<BinaryOp::logical_and>();
    case BinaryOp::logical_or: return body.template operator()<BinaryOp::logical_or>();
  }
  fail("binary: unknown op ", static_cast<int>(op));
}

// Which unary ops a dtype has, as on the CPU: bool has only logical_not (and the CPU
// applies it whatever op is asked), integers neg/abs/relu, floats all but logical_not.
template <UnaryOp Op, class T>
constexpr bool unary_defined() {
  if constexpr (std::is_same_v<T, bool>) return Op == UnaryOp::logical_not;
  else if constexpr (is_float_v<T>) return Op != UnaryOp::logical_not;
  else return Op == UnaryOp::neg || Op == UnaryOp::abs || Op == UnaryOp::relu;
}

}  // namespace

void CudaBackend::unary(UnaryOp op, const Tensor& in, const Tensor& out) {
  const int64_t n = out.numel();
  OnDevice on(out.device());
  const auto ix = make_indexer<2>(out.shape(), {&out.strides(), &in.strides()}, "unary");
  // The CPU backend computes logical_not for a bool input whatever the op.
  if (in.dtype() == DType::boolean) op = UnaryOp::logical_not;
  dispatch_device(in.dtype(), [&]<class T>() {
    with_unary(op, [&]<UnaryOp Op>() {
      if constexpr (unary_defined<Op, T>()) {
        if (n == 0) return;
        constexpr int pack_bytes = sizeof(T) * kPack<T>;
        if (is_dense(ix, {{in.data_ptr(), pack_bytes}, {out.data_ptr(), pack_bytes}}))
          unary_dense_kernel<Op, T><<<blocks_for((n + kPack<T> - 1) / kPack<T>), kThreads, 0, on.stream>>>(
              device_ptr<const T>(in), device_ptr<T>(out), n);
        else
          unary_kernel<Op, T><<<blocks_for(n), kThreads, 0, on.stream>>>(device_ptr<const T>(in), device_ptr<T>(out), ix, n);
        ZG_CUDA_CHECK_LAUNCH();
      } else {
        fail("unary: op ", static_cast<int>(op), " is not defined for ",
             is_float_v<T> ? "floating-point" : "integer", " tensors");
      }
    });
  });
}

void CudaBackend::binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  const int64_t n = out.numel();
  OnDevice on(out.device());
  const auto ix = make_indexer<3>(out.shape(), {&out.strides(), &a.strides(), &b.strides()}, "binary");
  dispatch_device(a.dtype(), [&]<class T>() {
    with_binary(op, [&]<BinaryOp Op>() {
      constexpr bool predicate = Op >= BinaryOp::eq;  // comparisons and logic: out is bool
      using Out = std::conditional_t<predicate, bool, T>;
      if constexpr (!predicate && std::is_same_v<T, bool>) {
        fail("binary: arithmetic is not defined for bool tensors");
      } else {
        if (n == 0) return;
        constexpr int in_pack = sizeof(T) * kPack<T>, out_pack = sizeof(Out) * kPack<T>;
        if (is_dense(ix, {{a.data_ptr(), in_pack}, {b.data_ptr(), in_pack}, {out.data_ptr(), out_pack}}))
          binary_dense_kernel<Op, T, Out><<<blocks_for((n + kPack<T> - 1) / kPack<T>), kThreads, 0, on.stream>>>(
              device_ptr<const T>(a), device_ptr<const T>(b), device_ptr<Out>(out), n);
        else
          binary_kernel<Op, T, Out><<<blocks_for(n), kThreads, 0, on.stream>>>(
              device_ptr<const T>(a), device_ptr<const T>(b), device_ptr<Out>(out), ix, n);
        ZG_CUDA_CHECK_LAUNCH();
      }
    });
  });
}

void CudaBackend::where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  const int64_t n = out.numel();
  if (n == 0) return;
  OnDevice on(out.device());
  const auto ix =
      make_indexer<4>(out.shape(), {&out.strides(), &cond.strides(), &a.strides(), &b.strides()}, "where");
  dispatch_device(a.dtype(), [&]<class T>() {
    where_kernel<T><<<blocks_for(n), kThreads, 0, on.stream>>>(device_ptr<const bool>(cond), device_ptr<const T>(a),
                                                               device_ptr<const T>(b), device_ptr<T>(out), ix, n);
    ZG_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace zg::cuda
