// What the ZeRO test files (tests/test_zero_*.cpp) share: the largest difference between
// two sets of named weights, one rank's copy of the gathered master weights, and a model
// of two small units.
#pragma once

#include <algorithm>
#include <memory>

#include "dist/zero/sharded_model.h"
#include "helpers.h"
#include "zerograd.h"

namespace zg::test {

// The largest elementwise difference between two sets of named tensors, matched by name.
inline double max_difference(const nn::NamedTensors& a, const nn::NamedTensors& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (const auto& [name, t] : a) {
    const auto it = std::find_if(b.begin(), b.end(), [&name = name](const auto& e) { return e.first == name; });
    REQUIRE(it != b.end());
    worst = std::max(worst, max(abs(t.to(kCPU).to(DType::f64) - it->second.to(kCPU).to(DType::f64))).item<double>());
  }
  return worst;
}

// The master weights, gathered on every rank (a collective), copied into `out` on rank `keeper`.
inline void keep_master(dist::ProcessGroup& pg, dist::ShardedModel& sharded, int keeper, nn::NamedTensors& out) {
  const nn::NamedTensors gathered = sharded.gathered_master();
  if (pg.rank() == keeper)
    for (const auto& [name, t] : gathered) out.emplace_back(name, t.clone());
}

// x [B, 3] -> a: Linear(3, 4) -> gelu -> b: Linear(4, 1), each a unit; b also holds a
// parameter no forward uses.
struct TwoLayers : nn::Module {
  std::shared_ptr<nn::Linear> a, b;
  TwoLayers() {
    a = register_module("a", std::make_shared<nn::Linear>(3, 4, true, 0.5, TensorOptions(DType::f64)));
    b = register_module("b", std::make_shared<nn::Linear>(4, 1, true, 0.5, TensorOptions(DType::f64)));
    b->register_parameter("unused", ones({2}, DType::f64));
  }
  Tensor forward(const Tensor& x) override { return (*b)(gelu((*a)(x))); }
};

}  // namespace zg::test
