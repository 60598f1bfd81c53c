#include "autograd/gradcheck.h"

#include <cmath>
#include <sstream>

#include "autograd/functions.h"
#include "autograd/graph.h"

namespace zg {

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                          const std::vector<Tensor>& inputs, double eps, double atol, double rtol) {
  ZG_CHECK(std::isfinite(eps) && eps > 0, "gradcheck: eps must be positive and finite, got ", eps);
  ZG_CHECK(std::isfinite(atol) && atol >= 0 && std::isfinite(rtol) && rtol >= 0,
           "gradcheck: atol and rtol must be >= 0 and finite, got ", atol, " and ", rtol);
  GradModeGuard grad_on(true);  // the analytic side needs a graph, whatever the caller's mode
  // Each input that requires grad is checked as a leaf of its own (a detached handle on
  // its data): non-leaf inputs work, the caller's .grad is left alone, and a tensor
  // passed twice is two inputs, each differentiated with the other held fixed -- as
  // the finite differences below shift one input at a time.
  std::vector<Tensor> leaves;
  for (const Tensor& x : inputs) {
    if (!x.defined() || !x.requires_grad()) {
      leaves.push_back(x);
      continue;
    }
    leaves.push_back(x.detach().set_requires_grad(true));
  }
  const Tensor probe = fn(leaves);
  ZG_CHECK(probe.defined() && is_floating(probe.dtype()), "gradcheck: fn must return a floating-point tensor, got ",
           describe(probe));
  const Tensor weights = randn(probe.shape(), TensorOptions(probe.dtype()).device(probe.device()));
  auto loss = [&](const std::vector<Tensor>& xs) { return sum(fn(xs) * weights); };

  const Tensor l = loss(leaves);
  if (l.requires_grad()) l.backward();

  GradcheckResult result;
  NoGradGuard no_grad;
  for (size_t i = 0; i < leaves.size(); ++i) {
    const Tensor& x = leaves[i];
    if (!x.defined() || !x.requires_grad()) continue;
    const std::vector<double> analytic =
        x.grad().defined() ? x.grad().to_vector<double>() : std::vector<double>(x.numel(), 0.0);
    const std::vector<double> values = x.to_vector<double>();
    for (int64_t j = 0; j < x.numel(); ++j) {
      auto shifted = [&](double delta) {
        std::vector<double> v = values;
        v[j] += delta;
        std::vector<Tensor> xs = leaves;
        xs[i] = tensor(v, x.shape(), TensorOptions(x.dtype()).device(x.device()));
        return loss(xs).item<double>();
      };
      const double numeric = (shifted(eps) - shifted(-eps)) / (2 * eps);
      const double error = std::fabs(analytic[j] - numeric);
      result.max_abs_error = std::max(result.max_abs_error, error);
      if (result.ok && !(error <= atol + rtol * std::fabs(numeric))) {
        std::ostringstream os;
        os << "input " << i << " (" << describe(x) << "), element " << j << ": backward gives " << analytic[j]
           << ", finite differences give " << numeric;
        if (x.dtype() != DType::f64)
          os << " (the input is " << name(x.dtype()) << ": finite differences with eps " << eps
             << " need f64 inputs -- pass x.to(DType::f64))";
        result.ok = false;
        result.message = os.str();
      }
    }
  }
  return result;
}

}  // namespace zg
