// Reductions over any set of dims, composed from one row-reduction kernel:
// permute the kept dims first and the reduced dims last, make that contiguous,
// and reduce each row of the resulting [kept, reduced] matrix.
#include <algorithm>

#include "autograd/functions.h"
#include "autograd/record.h"
#include "tensor/backend.h"
#include "tensor/checks.h"

namespace zg {

namespace {

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::mean: return "mean";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
    case ReduceOp::argmax: return "argmax";
    case ReduceOp::argmin: return "argmin";
    case ReduceOp::sum_of_squares: return "sum_of_squares";
  }
  return "reduce";
}

const DifferentiableOp kSum("sum"), kMean("mean"), kMax("max"), kMin("min"), kCumsum("cumsum");

const DifferentiableOp& op_def(ReduceOp op) {
  switch (op) {
    case ReduceOp::mean: return kMean;
    case ReduceOp::max: return kMax;
    case ReduceOp::min: return kMin;
    default: return kSum;
  }
}

// Gradient of one row reduction, rows [M, R] -> out [M]; the permute/view chain
// around it carries the gradient back to the input's layout.
//   sum: every element gets g;  mean: g / R;
//   max/min: the elements equal to the result share g equally (as torch.amax).
Node::Backward row_backward(ReduceOp op, const Tensor& rows, const Tensor& out) {
  const Shape shape = rows.shape();
  if (op == ReduceOp::sum || op == ReduceOp::mean)
    return [op, shape](const Tensor& g) {
      const Tensor spread = g.unsqueeze(1).expand(shape);
      return std::vector<Tensor>{op == ReduceOp::mean ? spread / static_cast<double>(shape[1]) : spread};
    };
  return [rows = SavedTensor(rows), out = SavedTensor(out)](const Tensor& g) {
    const Tensor x = rows.get("max/min");
    const Tensor hit = eq(x, out.get("max/min").unsqueeze(1)).to(g.dtype());
    return std::vector<Tensor>{hit * (g / sum(hit, {1})).unsqueeze(1)};
  };
}

Tensor reduce(ReduceOp op, const Tensor& input, const Shape& dims, bool keepdim) {
  const char* name = op_name(op);
  detail::check_defined(name, input);
  const bool is_arg = op == ReduceOp::argmax || op == ReduceOp::argmin;
  if (op == ReduceOp::mean || op == ReduceOp::sum_of_squares) detail::check_floating(name, input);
  if (op != ReduceOp::sum)
    ZG_CHECK(input.dtype() != DType::boolean, name, ": not defined for bool tensors, got ", describe(input));
  // Integers and bools sum into i64, as in PyTorch, so counts cannot overflow.
  const Tensor x_in = op == ReduceOp::sum && !is_floating(input.dtype()) ? input.to(DType::i64) : input;

  // A 0-d tensor reduces as the one element it holds, over dim 0 or -1 (as in PyTorch).
  const bool scalar = input.dim() == 0;
  if (scalar) {
    for (int64_t d : dims)
      ZG_CHECK(d == 0 || d == -1, name, ": dim ", d, " is out of range for a 0-d tensor (", describe(input), ")");
    ZG_CHECK(dims.size() <= 1, name, ": the dims ", shape_str(dims), " name the one dim of a 0-d tensor more than once");
  }
  const Tensor x = scalar ? x_in.reshape({1}) : x_in;
  const int64_t rank = x.dim();
  std::vector<bool> reduced(rank, dims.empty());
  for (int64_t d : dims) {
    const int64_t wrapped = wrap_dim(d, rank, name);
    ZG_CHECK(!reduced[wrapped], name, ": dim ", d, " appears more than once in the dims ", shape_str(dims), " of ", describe(input));
    reduced[wrapped] = true;
  }

  Shape order, kept_shape, out_shape;
  int64_t rows = 1, row_length = 1;
  for (int64_t d = 0; d < rank; ++d) {
    if (reduced[d]) continue;
    order.push_back(d);
    kept_shape.push_back(x.shape()[d]);
    rows *= x.shape()[d];
  }
  for (int64_t d = 0; d < rank; ++d) {
    if (reduced[d]) {
      order.push_back(d);
      row_length *= x.shape()[d];
    }
    if (keepdim || !reduced[d]) out_shape.push_back(reduced[d] ? 1 : x.shape()[d]);
  }
  ZG_CHECK(row_length > 0 || op == ReduceOp::sum || op == ReduceOp::mean || op == ReduceOp::sum_of_squares, name,
           ": cannot reduce over a zero-size dimension (", describe(x), ")");

  const Tensor rows_view = x.permute(order).contiguous().view({rows, row_length});
  const DType out_dtype = is_arg ? DType::i64
                          : op == ReduceOp::sum_of_squares ? (x.dtype() == DType::f64 ? DType::f64 : DType::f32)
                                                           : x.dtype();
  // The result is recorded in its own shape, so the graph's node for it is the reduction
  // (a backward error names "sum", not a reshape); the kernel writes its [rows] view.
  if (scalar) out_shape = {};
  const Tensor out = empty(out_shape, TensorOptions(out_dtype).device(x.device()));
  const Tensor out_rows = out.view({rows});
  backend(x.device()).reduce(op, rows_view, out_rows);
  if (is_arg || op == ReduceOp::sum_of_squares) return out;
  return differentiable(out, op_def(op), {rows_view},
                        [rows, backward = row_backward(op, rows_view, out_rows)](const Tensor& g) {
                          return backward(g.reshape({rows}));
                        });
}

}  // namespace

Tensor sum(const Tensor& x, const Shape& dims, bool keepdim) { return reduce(ReduceOp::sum, x, dims, keepdim); }
Tensor mean(const Tensor& x, const Shape& dims, bool keepdim) { return reduce(ReduceOp::mean, x, dims, keepdim); }
Tensor max(const Tensor& x, const Shape& dims, bool keepdim) { return reduce(ReduceOp::max, x, dims, keepdim); }
Tensor min(const Tensor& x, const Shape& dims, bool keepdim) { return reduce(ReduceOp::min, x, dims, keepdim); }
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) { return reduce(ReduceOp::argmax, x, {dim}, keepdim); }
Tensor argmin(const Tensor& x, int64_t dim, bool keepdim) { return reduce(ReduceOp::argmin, x, {dim}, keepdim); }
Tensor sum_of_squares(const Tensor& x) { return reduce(ReduceOp::sum_of_squares, x, {}, false); }

Tensor argmax(const Tensor& x) {
  detail::check_defined("argmax", x);
  return reduce(ReduceOp::argmax, x.reshape({-1}), {0}, false);
}

// The scanned dim moved last and the rest flattened to rows [M, R], scanned by the backend.
// d out_j / d x_i = 1 for j >= i: the gradient is the cumsum of g taken from the end.
Tensor cumsum(const Tensor& x, int64_t dim) {
  detail::check_defined("cumsum", x);
  if (x.dim() == 0) {  // the one element, over dim 0 or -1
    wrap_dim(dim, 1, "cumsum");
    return cumsum(x.reshape({1}), 0).reshape({});
  }
  dim = wrap_dim(dim, x.dim(), "cumsum");
  const Tensor input = is_floating(x.dtype()) ? x : x.to(DType::i64);  // integers and bools sum into i64
  const Tensor moved = input.transpose(dim, -1).contiguous();
  const int64_t length = moved.size(-1);
  const Tensor rows = moved.view({length == 0 ? 0 : moved.numel() / length, length});
  const Tensor scanned = empty(rows.shape(), detail::options_of(input));
  backend(x.device()).cumsum_rows(rows, scanned);
  const Tensor out = differentiable(scanned, kCumsum, {rows}, [](const Tensor& g) {
    return std::vector<Tensor>{flip(cumsum(flip(g, {1}), 1), {1})};
  });
  return out.view(moved.shape()).transpose(dim, -1).contiguous();
}

}  // namespace zg
