#include "nn/init.h"

#include <cmath>

#include "autograd/graph.h"

namespace zg::nn::init {

namespace {

TensorOptions options_of(const Tensor& t) { return TensorOptions(t.dtype()).device(t.device()); }

void write(const char* op, const Tensor& t, const Tensor& values) {
  ZG_CHECK(t.defined() && is_floating(t.dtype()), "init::", op, ": expected a floating tensor, got ", describe(t));
  NoGradGuard no_grad;
  Tensor(t).copy_(values);
}

std::pair<double, double> fans(const char* op, const Tensor& t) {
  ZG_CHECK(t.defined() && t.dim() >= 2, "init::", op, ": fans need a tensor of rank >= 2, got ", describe(t));
  const double receptive = static_cast<double>(t.numel() / std::max<int64_t>(1, t.size(0) * t.size(1)));
  return {static_cast<double>(t.size(1)) * receptive, static_cast<double>(t.size(0)) * receptive};
}

double kaiming_std(const char* op, const Tensor& t, double a, Fan fan) {
  const auto [in, out] = fans(op, t);
  return std::sqrt(2.0 / ((1.0 + a * a) * (fan == Fan::in ? in : out)));
}

}  // namespace

void normal_(const Tensor& t, double mean, double std) {
  ZG_CHECK(std >= 0, "init::normal_: std must be non-negative, got ", std);
  write("normal_", t, normal(t.shape(), mean, std, options_of(t)));
}

void uniform_(const Tensor& t, double low, double high) {
  ZG_CHECK(low <= high, "init::uniform_: low ", low, " is above high ", high);
  write("uniform_", t, uniform(t.shape(), low, high, options_of(t)));
}

void constant_(const Tensor& t, double value) { write("constant_", t, full(t.shape(), value, options_of(t))); }
void zeros_(const Tensor& t) { constant_(t, 0.0); }
void ones_(const Tensor& t) { constant_(t, 1.0); }

void xavier_uniform_(const Tensor& t, double gain) {
  const auto [in, out] = fans("xavier_uniform_", t);
  const double a = gain * std::sqrt(6.0 / (in + out));
  uniform_(t, -a, a);
}

void xavier_normal_(const Tensor& t, double gain) {
  const auto [in, out] = fans("xavier_normal_", t);
  normal_(t, 0.0, gain * std::sqrt(2.0 / (in + out)));
}

void kaiming_uniform_(const Tensor& t, double a, Fan fan) {
  const double bound = std::sqrt(3.0) * kaiming_std("kaiming_uniform_", t, a, fan);
  uniform_(t, -bound, bound);
}

void kaiming_normal_(const Tensor& t, double a, Fan fan) { normal_(t, 0.0, kaiming_std("kaiming_normal_", t, a, fan)); }

void linear_default_(Linear& layer) {
  kaiming_uniform_(layer.weight, std::sqrt(5.0));
  if (layer.bias.defined()) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(layer.weight.size(1)));
    uniform_(layer.bias, -bound, bound);
  }
}

void linear_default_all(Module& module) {
  for (const auto& [_, m] : module.named_modules())
    if (auto* linear = dynamic_cast<Linear*>(m)) linear_default_(*linear);
}

}  // namespace zg::nn::init
