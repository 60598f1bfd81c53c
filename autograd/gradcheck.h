// gradcheck: compares the gradients backward() computes with central finite
// differences, in f64, the way torch.autograd.gradcheck does.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace zg {

struct GradcheckResult {
  bool ok = true;
  double max_abs_error = 0;  // over all checked elements
  std::string message;       // the first mismatch: input, element, analytic and numeric values
};

// For every input that requires grad, checks d/dx of L = sum(fn(inputs) * w), with w a
// fixed random tensor (so every output element counts), against (L(x+eps) - L(x-eps)) / 2eps
// per element: |analytic - numeric| <= atol + rtol |numeric|. Inputs should be f64 (a
// mismatch on other inputs says so).
// Each input is differentiated as a leaf of its own: the inputs' .grad are left alone.
GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                          const std::vector<Tensor>& inputs, double eps = 1e-6, double atol = 1e-6,
                          double rtol = 1e-4);

}  // namespace zg
