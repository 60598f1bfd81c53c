// matmul: broadcasting of batch dims and transposes are views; the kernel sees
// [B, M, K] @ [B, K, N] with each matrix row- or column-major (what BLAS takes).
#include "autograd/functions.h"
#include "autograd/record.h"
#include "tensor/backend.h"
#include "tensor/checks.h"

namespace zg {

namespace {

// A matrix BLAS can read in place has unit stride along its rows or its columns.
Tensor blas_layout(const Tensor& m) {
  const auto& s = m.strides();
  const int64_t rows = m.shape()[m.dim() - 2], cols = m.shape()[m.dim() - 1];
  const int64_t rs = s[m.dim() - 2], cs = s[m.dim() - 1];
  const bool row_major = cs == 1 && rs >= std::max<int64_t>(cols, 1);
  const bool col_major = rs == 1 && cs >= std::max<int64_t>(rows, 1);
  return row_major || col_major ? m : m.contiguous();
}

// A BLAS-ready matrix stored column by column: a transposed view.
bool column_major(const Tensor& m) { return m.strides()[m.dim() - 2] == 1 && m.strides()[m.dim() - 1] != 1; }

const DifferentiableOp kMatmul("matmul"), kLinear("linear"), kMlp("mlp");

}  // namespace

Tensor matmul(const Tensor& a_in, const Tensor& b_in, bool trans_a, bool trans_b) {
  detail::check_compatible("matmul", a_in, b_in);
  detail::check_floating("matmul", a_in);
  ZG_CHECK(a_in.dim() >= 1 && b_in.dim() >= 1, "matmul: expected tensors of rank >= 1, got ", describe(a_in),
           " and ", describe(b_in));
  ZG_CHECK(!(trans_a && a_in.dim() < 2) && !(trans_b && b_in.dim() < 2),
           "matmul: a transpose needs rank >= 2, got ", describe(a_in), " and ", describe(b_in));
  // torch.matmul: a vector on the left is a row, on the right a column; the added dim is removed after.
  const Tensor a = a_in.dim() == 1 ? a_in.unsqueeze(0) : (trans_a ? a_in.t() : a_in);
  const Tensor b = b_in.dim() == 1 ? b_in.unsqueeze(1) : (trans_b ? b_in.t() : b_in);
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  ZG_CHECK(b.size(-2) == k, "matmul: shapes ", shape_str(a.shape()), " and ", shape_str(b.shape()),
           " cannot be multiplied (", k, " != ", b.size(-2), ")");

  const Shape a_batch(a.shape().begin(), a.shape().end() - 2), b_batch(b.shape().begin(), b.shape().end() - 2);
  const Shape batch = broadcast_shapes(a_batch, b_batch, "matmul");
  const int64_t batches = numel(batch);
  auto with_batch = [&](int64_t rows, int64_t cols) {
    Shape s = batch;
    s.push_back(rows);
    s.push_back(cols);
    return s;
  };
  const Tensor a3 = blas_layout(a.expand(with_batch(m, k)).reshape({batches, m, k}));
  const Tensor b3 = blas_layout(b.expand(with_batch(k, n)).reshape({batches, k, n}));
  Tensor out = empty({batches, m, n}, detail::options_of(a));
  backend(a.device()).matmul(a3, b3, out);
  // C = A B:  dA = dC B^T,  dB = A^T dC  (per batch; broadcast batches are summed by expand's backward).
  // Each in its input's layout, as PyTorch's mm backward: for a column-major input (a
  // transposed weight: the tied LM head's) the transposed product, (B dC^T)^T or
  // (dC^T A)^T, so the gradient reaches the weight contiguous rather than as a strided view.
  // A GEMM whose gradient the pass does not want (a split backward's) is skipped.
  out = differentiable(out, kMatmul, {a3, b3}, [a3 = SavedTensor(a3), b3 = SavedTensor(b3)](const Tensor& g) {
    const Tensor A = a3.get("matmul"), B = b3.get("matmul");
    Tensor dA, dB;
    if (needs_input_grad(0))
      dA = column_major(A) ? matmul(B, g, false, true).transpose(-1, -2) : matmul(g, B, false, true);
    if (needs_input_grad(1))
      dB = column_major(B) ? matmul(g, A, true, false).transpose(-1, -2) : matmul(A, g, true, false);
    return std::vector<Tensor>{dA, dB};
  });

  Shape out_shape = with_batch(m, n);
  if (b_in.dim() == 1) out_shape.erase(out_shape.end() - 1);
  if (a_in.dim() == 1) out_shape.erase(out_shape.end() - (b_in.dim() == 1 ? 1 : 2));
  return out.view(out_shape);
}

namespace {

// x [..., K] as rows, weight [N, K] and bias [N] (or undefined) as the kernels take them,
// after checking they fit together; `op` names the caller in errors.
struct LinearOperands {
  Tensor rows, weight, bias;
};
LinearOperands linear_operands(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  detail::check_floating(op, x);
  detail::check_compatible(op, x, weight);
  ZG_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1), op, ": input ", describe(x),
           " does not end in the ", weight.dim() == 2 ? weight.size(1) : -1, " features of weight ", describe(weight),
           " ([out, in])");
  if (bias.defined()) {
    detail::check_compatible(op, x, bias);
    ZG_CHECK(bias.shape() == Shape{weight.size(0)}, op, ": bias ", describe(bias), " must be [", weight.size(0), "]");
  }
  return {detail::as_rows(x), weight.contiguous(), bias.defined() ? bias.contiguous() : bias};
}

// The gradients of y = x W^T + b for g = dL/dy: dx = g W (if `input`), and (if `params`)
// dW = g^T x, db = sum over rows of g; undefined where not wanted (x then may be too).
std::vector<Tensor> linear_grads(const Tensor& g, const Tensor& x, const Tensor& weight, bool has_bias, bool input,
                                 bool params) {
  Tensor dw, db;
  if (params) {
    dw = empty(weight.shape(), detail::options_of(weight));
    db = has_bias ? empty({weight.size(0)}, detail::options_of(weight)) : Tensor();
    backend(g.device()).linear_weight_grad(g, x, dw, db);
  }
  return {input ? matmul(g, weight) : Tensor(), dw, db};
}

Shape with_last(Shape shape, int64_t last) {
  shape.back() = last;
  return shape;
}

}  // namespace

// pre = x W^T + b, y = act(pre). With g' = dL/dpre (= g * gelu'(pre) for GELU, one pass):
//   dx = g' W,   dW = g'^T x,   db = sum over rows of g'
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias, Activation act) {
  static constexpr const char* name = "linear";
  const auto [rows, w, b] = linear_operands(name, x, weight, bias);
  const TensorOptions options = detail::options_of(x);
  Tensor out = empty({rows.size(0), w.size(0)}, options);
  const Tensor pre = act == Activation::none ? Tensor() : empty({rows.size(0), w.size(0)}, options);
  backend(x.device()).linear(rows, w, b, act, out, pre);
  out = differentiable(
      out, kLinear, {rows, w, b},
      [rows = SavedTensor(rows), w = SavedTensor(w), pre = SavedTensor(pre), act, has_bias = b.defined()](
          const Tensor& g_in) {
        const Tensor g = act == Activation::gelu ? gelu_backward(pre.get(name), g_in) : g_in.contiguous();
        return linear_grads(g, rows.get(name), w.get(name), has_bias, needs_input_grad(0),
                            needs_input_grad(1) || needs_input_grad(2));
      });
  return out.view(with_last(x.shape(), w.size(0)));
}

// h = gelu(p), p = x W1^T + b1, y = h W2^T + b2; only x and p are kept, h is made again:
//   dW2 = g^T h,  db2 = sum over rows of g,  dh = g W2,  dp = dh * gelu'(p),
//   dx = dp W1,   dW1 = dp^T x,              db1 = sum over rows of dp
// (each only where the pass wants it: dx alone needs no h; dW1 and db1 need dh and dp too).
Tensor mlp(const Tensor& x, const Tensor& fc_weight, const Tensor& fc_bias, const Tensor& proj_weight,
           const Tensor& proj_bias) {
  static constexpr const char* name = "mlp";
  const auto [rows, w1, b1] = linear_operands(name, x, fc_weight, fc_bias);
  const TensorOptions options = detail::options_of(x);
  const Tensor pre = empty({rows.size(0), w1.size(0)}, options);
  const auto [h, w2, b2] = linear_operands(name, empty_like(pre), proj_weight, proj_bias);  // h: freed on return
  Tensor out = empty({rows.size(0), w2.size(0)}, options);
  backend(x.device()).linear(rows, w1, b1, Activation::gelu, h, pre);
  backend(x.device()).linear(h, w2, b2, Activation::none, out, Tensor());
  out = differentiable(
      out, kMlp, {rows, w1, b1, w2, b2},
      [rows = SavedTensor(rows), w1 = SavedTensor(w1), w2 = SavedTensor(w2), pre = SavedTensor(pre),
       has_b1 = b1.defined(), has_b2 = b2.defined()](const Tensor& g_in) {
        const Tensor g = g_in.contiguous(), p = pre.get(name);
        const bool dx = needs_input_grad(0), fc_params = needs_input_grad(1) || needs_input_grad(2),
                   proj_params = needs_input_grad(3) || needs_input_grad(4);
        // {dh, dW2, db2}, with h made again (grad mode is off here: gelu records nothing) and freed at once.
        const std::vector<Tensor> proj =
            linear_grads(g, proj_params ? gelu(p) : Tensor(), w2.get(name), has_b2, dx || fc_params, proj_params);
        if (!dx && !fc_params) return std::vector<Tensor>{Tensor(), Tensor(), Tensor(), proj[1], proj[2]};
        const std::vector<Tensor> fc =
            linear_grads(gelu_backward(p, proj[0]), rows.get(name), w1.get(name), has_b1, dx, fc_params);
        return std::vector<Tensor>{fc[0], fc[1], fc[2], proj[1], proj[2]};
      });
  return out.view(with_last(x.shape(), w2.size(0)));
}

}  // namespace zg
