// Elementwise front-ends, each with its gradient beside it. Broadcasting is a
// view: inputs are expanded to the output's shape (stride 0 where broadcast), so
// kernels only see equal shapes, and gradients are summed back with sum_to().
#include "autograd/functions.h"
#include "autograd/record.h"
#include "tensor/backend.h"
#include "tensor/checks.h"

namespace zg {

using detail::check_compatible;
using detail::check_defined;
using detail::options_of;
using detail::scalar_like;

namespace {

using Grads = std::vector<Tensor>;

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
  } else if (op == BinaryOp::div || op == BinaryOp::pow || op == BinaryOp::gelu_backward) {
    detail::check_floating(name, a);
  } else if (!is_comparison(op)) {
    ZG_CHECK(a.dtype() != DType::boolean, name, ": not defined for bool tensors, got ", describe(a), " and ",
             describe(b));
  }
  const Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  const DType dtype = is_comparison(op) ? DType::boolean : a.dtype();
  Tensor out = empty(shape, TensorOptions(dtype).device(a.device()));
  NoGradGuard no_grad;  // the expand views are internal; the op records itself
  backend(a.device()).binary(op, a.expand(shape), b.expand(shape), out);
  return out;
}

Tensor zeros_as(const Tensor& g) { return zeros_like(g); }

const DifferentiableOp kNeg("neg"), kAbs("abs"), kExp("exp"), kLog("log"), kSqrt("sqrt"), kRsqrt("rsqrt"),
    kSin("sin"), kCos("cos"), kTanh("tanh"), kSigmoid("sigmoid"), kRelu("relu"), kGelu("gelu"), kErf("erf"), kLog1p("log1p"), kAdd("add"),
    kSub("sub"), kMul("mul"), kDiv("div"), kPow("pow"), kMaximum("maximum"), kMinimum("minimum"),
    kWhere("where");

}  // namespace

// ---- unary: y = f(x), dx = g * f'(x) ----

Tensor neg(const Tensor& x) {
  return differentiable(unary(UnaryOp::neg, x, "neg"), kNeg, {x}, [](const Tensor& g) { return Grads{neg(g)}; });
}

// d|x| = sign(x) (0 at 0)
Tensor abs(const Tensor& x) {
  return differentiable(unary(UnaryOp::abs, x, "abs"), kAbs, {x}, [x = SavedTensor(x)](const Tensor& g) {
    const Tensor v = x.get("abs");
    return Grads{where(gt(v, 0.0), g, where(lt(v, 0.0), neg(g), zeros_as(g)))};
  });
}

// d exp(x) = exp(x)
Tensor exp(const Tensor& x) {
  const Tensor y = unary(UnaryOp::exp, x, "exp");
  return differentiable(y, kExp, {x}, [y = SavedTensor(y)](const Tensor& g) { return Grads{g * y.get("exp")}; });
}

// d log(x) = 1 / x
Tensor log(const Tensor& x) {
  return differentiable(unary(UnaryOp::log, x, "log"), kLog, {x},
                        [x = SavedTensor(x)](const Tensor& g) { return Grads{g / x.get("log")}; });
}

// d sqrt(x) = 1 / (2 sqrt(x))
Tensor sqrt(const Tensor& x) {
  const Tensor y = unary(UnaryOp::sqrt, x, "sqrt");
  return differentiable(y, kSqrt, {x},
                        [y = SavedTensor(y)](const Tensor& g) { return Grads{g / (y.get("sqrt") * 2.0)}; });
}

// d x^(-1/2) = -x^(-3/2) / 2 = -y^3 / 2
Tensor rsqrt(const Tensor& x) {
  const Tensor y = unary(UnaryOp::rsqrt, x, "rsqrt");
  return differentiable(y, kRsqrt, {x}, [y = SavedTensor(y)](const Tensor& g) {
    const Tensor v = y.get("rsqrt");
    return Grads{g * v * v * v * -0.5};
  });
}

Tensor sin(const Tensor& x) {
  return differentiable(unary(UnaryOp::sin, x, "sin"), kSin, {x},
                        [x = SavedTensor(x)](const Tensor& g) { return Grads{g * cos(x.get("sin"))}; });
}

Tensor cos(const Tensor& x) {
  return differentiable(unary(UnaryOp::cos, x, "cos"), kCos, {x},
                        [x = SavedTensor(x)](const Tensor& g) { return Grads{neg(g * sin(x.get("cos")))}; });
}

// d tanh(x) = 1 - tanh(x)^2
Tensor tanh(const Tensor& x) {
  const Tensor y = unary(UnaryOp::tanh, x, "tanh");
  return differentiable(y, kTanh, {x}, [y = SavedTensor(y)](const Tensor& g) {
    const Tensor v = y.get("tanh");
    return Grads{g * (1.0 - v * v)};
  });
}

// d sigmoid(x) = y (1 - y)
Tensor sigmoid(const Tensor& x) {
  const Tensor y = unary(UnaryOp::sigmoid, x, "sigmoid");
  return differentiable(y, kSigmoid, {x}, [y = SavedTensor(y)](const Tensor& g) {
    const Tensor v = y.get("sigmoid");
    return Grads{g * v * (1.0 - v)};
  });
}

Tensor relu(const Tensor& x) {
  return differentiable(unary(UnaryOp::relu, x, "relu"), kRelu, {x}, [x = SavedTensor(x)](const Tensor& g) {
    return Grads{where(le(x.get("relu"), 0.0), zeros_as(g), g)};  // NaN passes g through, as the forward passes NaN
  });
}

// y = x/2 (1 + tanh(u)), u = k (x + c x^3), k = sqrt(2/pi), c = 0.044715:
// dy = (1 + tanh(u)) / 2 + x/2 (1 - tanh(u)^2) k (1 + 3 c x^2), one kernel (BinaryOp::gelu_backward)
Tensor gelu_backward(const Tensor& x, const Tensor& grad) {
  return binary(BinaryOp::gelu_backward, x, grad, "gelu_backward");
}

Tensor gelu(const Tensor& x) {
  return differentiable(unary(UnaryOp::gelu, x, "gelu"), kGelu, {x}, [x = SavedTensor(x)](const Tensor& g) {
    return Grads{gelu_backward(x.get("gelu"), g)};
  });
}

// d erf(x) = 2/sqrt(pi) exp(-x^2)
Tensor erf(const Tensor& x) {
  return differentiable(unary(UnaryOp::erf, x, "erf"), kErf, {x}, [x = SavedTensor(x)](const Tensor& g) {
    const Tensor v = x.get("erf");
    return Grads{g * exp(neg(v * v)) * 1.1283791670955126};
  });
}

// d log(1 + x) = 1 / (1 + x)
Tensor log1p(const Tensor& x) {
  return differentiable(unary(UnaryOp::log1p, x, "log1p"), kLog1p, {x},
                        [x = SavedTensor(x)](const Tensor& g) { return Grads{g / (x.get("log1p") + 1.0)}; });
}

Tensor logical_not(const Tensor& x) { return unary(UnaryOp::logical_not, x, "logical_not"); }

// ---- binary: gradients are summed back over broadcast dims ----
// The forward runs (and validates) before a backward closure reads the inputs.

Tensor add(const Tensor& a, const Tensor& b) {
  const Tensor out = binary(BinaryOp::add, a, b, "add");
  return differentiable(out, kAdd, {a, b}, [sa = a.shape(), sb = b.shape()](const Tensor& g) {
    return Grads{sum_to(g, sa), sum_to(g, sb)};
  });
}

Tensor sub(const Tensor& a, const Tensor& b) {
  const Tensor out = binary(BinaryOp::sub, a, b, "sub");
  return differentiable(out, kSub, {a, b}, [sa = a.shape(), sb = b.shape()](const Tensor& g) {
    return Grads{sum_to(g, sa), sum_to(neg(g), sb)};
  });
}

// d(ab) = b da + a db
// d(a b) = b da + a db: each operand is kept only for the other's gradient (as PyTorch),
// so x times a constant keeps no copy of x.
Tensor mul(const Tensor& a, const Tensor& b) {
  const Tensor out = binary(BinaryOp::mul, a, b, "mul");
  const bool a_needs = a.requires_grad(), b_needs = b.requires_grad();
  return differentiable(out, kMul, {a, b},
                        [a = b_needs ? SavedTensor(a) : SavedTensor(), b = a_needs ? SavedTensor(b) : SavedTensor(),
                         sa = a.shape(), sb = b.shape(), a_needs, b_needs](const Tensor& g) {
                          return Grads{a_needs ? sum_to(g * b.get("mul"), sa) : Tensor(),
                                       b_needs ? sum_to(g * a.get("mul"), sb) : Tensor()};
                        });
}

// d(a/b) = da / b - a db / b^2
Tensor div(const Tensor& a, const Tensor& b) {
  const Tensor out = binary(BinaryOp::div, a, b, "div");
  return differentiable(out, kDiv, {a, b}, [a = SavedTensor(a), b = SavedTensor(b)](const Tensor& g) {
    const Tensor va = a.get("div"), vb = b.get("div");
    return Grads{sum_to(g / vb, va.shape()), sum_to(neg(g) * va / (vb * vb), vb.shape())};
  });
}

// d(a^b) = b a^(b-1) da + a^b log(a) db; the second term only when b needs it (log a < 0 is NaN).
// At a = 0 the formulas hold 0 * inf; the limits are taken, as PyTorch does: da's term is 0
// where b = 0 (a^0 is constant), db's where a = 0 and b >= 0.
Tensor pow(const Tensor& a, const Tensor& b) {
  const Tensor y = binary(BinaryOp::pow, a, b, "pow");
  return differentiable(y, kPow, {a, b},
                        [a = SavedTensor(a), b = SavedTensor(b), y = SavedTensor(y),
                         b_needs = b.requires_grad()](const Tensor& g) {
                          const Tensor va = a.get("pow"), vb = b.get("pow");
                          // g multiplies the masked term, so a NaN or inf gradient still passes through.
                          Grads grads{sum_to(g * where(eq(vb, 0.0), 0.0, vb * pow(va, vb - 1.0)), va.shape()), Tensor()};
                          if (b_needs)
                            grads[1] = sum_to(g * where(logical_and(eq(va, 0.0), ge(vb, 0.0)), 0.0, y.get("pow") * log(va)),
                                              vb.shape());
                          return grads;
                        });
}

// The larger (smaller) input takes the gradient; a tie splits it in half; an input that
// did not lose takes all of it -- so where a NaN makes the comparison false both do, as in
// PyTorch.
static Tensor extremum(BinaryOp op, const Tensor& a, const Tensor& b, const char* name, const DifferentiableOp& def) {
  const Tensor out = binary(op, a, b, name);
  return differentiable(out, def, {a, b}, [a = SavedTensor(a), b = SavedTensor(b), op, name](const Tensor& g) {
    const Tensor va = a.get(name), vb = b.get(name);
    const Tensor a_loses = op == BinaryOp::maximum ? lt(va, vb) : gt(va, vb);
    const Tensor b_loses = op == BinaryOp::maximum ? gt(va, vb) : lt(va, vb);
    const Tensor tie = eq(va, vb);
    const auto share = [&](const Tensor& loses) { return where(tie, 0.5, where(loses, 0.0, ones_like(g))); };
    return Grads{sum_to(g * share(a_loses), va.shape()), sum_to(g * share(b_loses), vb.shape())};
  });
}
Tensor maximum(const Tensor& a, const Tensor& b) { return extremum(BinaryOp::maximum, a, b, "maximum", kMaximum); }
Tensor minimum(const Tensor& a, const Tensor& b) { return extremum(BinaryOp::minimum, a, b, "minimum", kMinimum); }

Tensor eq(const Tensor& a, const Tensor& b) { return binary(BinaryOp::eq, a, b, "eq"); }
Tensor ne(const Tensor& a, const Tensor& b) { return binary(BinaryOp::ne, a, b, "ne"); }
Tensor lt(const Tensor& a, const Tensor& b) { return binary(BinaryOp::lt, a, b, "lt"); }
Tensor le(const Tensor& a, const Tensor& b) { return binary(BinaryOp::le, a, b, "le"); }
Tensor gt(const Tensor& a, const Tensor& b) { return binary(BinaryOp::gt, a, b, "gt"); }
Tensor ge(const Tensor& a, const Tensor& b) { return binary(BinaryOp::ge, a, b, "ge"); }
Tensor logical_and(const Tensor& a, const Tensor& b) { return binary(BinaryOp::logical_and, a, b, "logical_and"); }
Tensor logical_or(const Tensor& a, const Tensor& b) { return binary(BinaryOp::logical_or, a, b, "logical_or"); }

// Scalar right-hand sides: the scalar becomes a 0-dim constant of the tensor's dtype.
#define ZG_SCALAR_RHS(fn)                         \
  Tensor fn(const Tensor& a, double b) {          \
    check_defined(#fn, a);                        \
    return fn(a, scalar_like(#fn, a, b));              \
  }
ZG_SCALAR_RHS(add)
ZG_SCALAR_RHS(sub)
ZG_SCALAR_RHS(mul)
ZG_SCALAR_RHS(div)
ZG_SCALAR_RHS(pow)
ZG_SCALAR_RHS(maximum)
ZG_SCALAR_RHS(minimum)
ZG_SCALAR_RHS(eq)
ZG_SCALAR_RHS(ne)
ZG_SCALAR_RHS(lt)
ZG_SCALAR_RHS(le)
ZG_SCALAR_RHS(gt)
ZG_SCALAR_RHS(ge)
#undef ZG_SCALAR_RHS

// out = cond ? a : b:  da = g where cond, db = g elsewhere.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  check_defined("where", cond);
  check_compatible("where", a, b);
  ZG_CHECK(cond.dtype() == DType::boolean, "where: expected a bool condition, got ", describe(cond));
  ZG_CHECK(cond.device() == a.device(), "where: device mismatch: ", describe(cond), " and ", describe(a));
  const Shape shape = broadcast_shapes(broadcast_shapes(cond.shape(), a.shape(), "where"), b.shape(), "where");
  Tensor out = empty(shape, options_of(a));
  {
    NoGradGuard no_grad;
    backend(a.device()).where(cond.expand(shape), a.expand(shape), b.expand(shape), out);
  }
  return differentiable(out, kWhere, {a, b},
                        [cond = SavedTensor(cond), sa = a.shape(), sb = b.shape()](const Tensor& g) {
                          const Tensor c = cond.get("where"), zero = zeros_as(g);
                          return Grads{sum_to(where(c, g, zero), sa), sum_to(where(c, zero, g), sb)};
                        });
}

Tensor where(const Tensor& cond, double a, const Tensor& b) {
  check_defined("where", b);
  return where(cond, scalar_like("where", b, a), b);
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  check_defined("masked_fill", x);
  check_defined("masked_fill", mask);
  ZG_CHECK(broadcast_shapes(mask.shape(), x.shape(), "masked_fill") == x.shape(), "masked_fill: mask shape ",
           shape_str(mask.shape()), " does not broadcast to the tensor's shape ", shape_str(x.shape()));
  return where(mask, scalar_like("masked_fill", x, value), x);
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
Tensor operator-(double a, const Tensor& b) { check_defined("sub", b); return sub(scalar_like("sub", b, a), b); }
Tensor operator*(double a, const Tensor& b) { return mul(b, a); }
Tensor operator/(double a, const Tensor& b) { check_defined("div", b); return div(scalar_like("div", b, a), b); }

}  // namespace zg
