#include "optim/adamw.h"

#include <fnmatch.h>

#include <cmath>

#include "tensor/backend.h"
#include "tensor/trace.h"

namespace zg::optim {

DType master_dtype_for(DType compute_dtype) { return accumulate_type(compute_dtype); }

void check_options(const AdamWOptions& o) {
  const auto fraction = [](double x) { return std::isfinite(x) && x >= 0 && x < 1; };
  ZG_CHECK(fraction(o.beta1) && fraction(o.beta2), "AdamW: beta1 and beta2 must lie in [0, 1), got ", o.beta1, " and ",
           o.beta2);
  ZG_CHECK(std::isfinite(o.eps) && o.eps > 0, "AdamW: eps must be positive and finite (it keeps m / (sqrt(v) + eps) "
           "finite where v is 0), got ", o.eps);
  ZG_CHECK(std::isfinite(o.weight_decay) && o.weight_decay >= 0, "AdamW: weight_decay must be >= 0 and finite, got ",
           o.weight_decay);
  for (size_t g = 0; g < o.groups.size(); ++g) {
    const ParamGroup& group = o.groups[g];
    ZG_CHECK(!group.names.empty(), "AdamW: parameter group ", g, " names no parameters");
    ZG_CHECK(std::isfinite(group.lr_scale) && group.lr_scale >= 0, "AdamW: parameter group ", g,
             ": lr_scale must be >= 0 and finite, got ", group.lr_scale);
    ZG_CHECK(!group.weight_decay || (std::isfinite(*group.weight_decay) && *group.weight_decay >= 0),
             "AdamW: parameter group ", g, ": weight_decay must be >= 0 and finite, got ", group.weight_decay.value_or(0));
  }
}

int group_of(const std::vector<ParamGroup>& groups, const std::string& name) {
  for (size_t g = 0; g < groups.size(); ++g)
    for (const std::string& pattern : groups[g].names)
      if (fnmatch(pattern.c_str(), name.c_str(), 0) == 0) return static_cast<int>(g);
  return -1;
}

void adamw_update(const std::vector<AdamWSpan>& spans, const AdamWOptions& options, double lr, int64_t step,
                  double grad_scale, const Tensor& device_scale) {
  check_options(options);
  ZG_CHECK(std::isfinite(lr) && lr >= 0, "AdamW: lr must be >= 0 and finite, got ", lr);
  ZG_CHECK(std::isfinite(grad_scale) && grad_scale >= 0, "AdamW: grad_scale must be >= 0 and finite, got ",
           grad_scale);
  ZG_CHECK(step >= 1, "AdamW: step counts from 1 (the bias corrections divide by 1 - beta^step), got ", step);
  TraceRange range("adamw");
  for (const AdamWSpan& span : spans) {
    if (span.master.numel() == 0) continue;
    const double decay = span.group_weight_decay.value_or(span.weight_decay ? options.weight_decay : 0.0);
    const AdamWStep s{lr * span.lr_scale, options.beta1, options.beta2, options.eps, decay, grad_scale, step, device_scale};
    backend(span.master.device()).adamw(span.master, span.grad, span.m, span.v, span.compute, s);
    span.master.storage()->bump_version();
    if (span.compute.defined()) span.compute.storage()->bump_version();
  }
}

}  // namespace zg::optim
