#include "autograd/gradcheck.h"

#include <cmath>
#include <sstream>

#include "tensor/autograd.h"
#include "tensor/ops.h"

namespace zg {

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                          const std::vector<Tensor>& inputs, double eps, double atol, double rtol) {
  const Tensor probe = fn(inputs);
  const Tensor weights = randn(probe.shape(), TensorOptions(probe.dtype()).device(probe.device()));
  auto loss = [&](const std::vector<Tensor>& xs) { return sum(fn(xs) * weights); };

  for (const Tensor& x : inputs)
    if (x.requires_grad()) x.set_grad(Tensor());
  const Tensor l = loss(inputs);
  if (l.requires_grad()) l.backward();

  GradcheckResult result;
  NoGradGuard no_grad;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& x = inputs[i];
    if (!x.requires_grad()) continue;
    const std::vector<double> analytic =
        x.grad().defined() ? x.grad().to_vector<double>() : std::vector<double>(x.numel(), 0.0);
    const std::vector<double> values = x.to_vector<double>();
    for (int64_t j = 0; j < x.numel(); ++j) {
      auto shifted = [&](double delta) {
        std::vector<double> v = values;
        v[j] += delta;
        std::vector<Tensor> xs = inputs;
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
        result.ok = false;
        result.message = os.str();
      }
    }
  }
  return result;
}

}  // namespace zg
