// The model of tasks 1 and 3: `depth` layers Linear(width, width), each a unit of its
// own (the root unit holds nothing), built deferred so that a ShardedModel on the meta
// device counts every byte and allocates none.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "nn/layers.h"
#include "zerograd.h"

namespace zg::tasks {

struct Tower : nn::Module {
  std::shared_ptr<nn::ModuleList> layers;
  Tower(int depth, int64_t width, TensorOptions options) {
    layers = register_module("layers", std::make_shared<nn::ModuleList>());
    for (int i = 0; i < depth; ++i) layers->push_back(std::make_shared<nn::Linear>(width, width, true, 0.02, options));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = x;
    for (size_t i = 0; i < layers->size(); ++i) h = (*layers)[i](h);
    return h;
  }
  nn::UnitPlan unit_plan() const override {
    nn::UnitPlan plan;
    for (size_t i = 0; i < layers->size(); ++i) plan.units.push_back("layers." + std::to_string(i));
    return plan;
  }
};

// A Tower on the meta device whose parameters are recipes, not bytes.
inline std::unique_ptr<Tower> deferred_meta_tower(int depth, int64_t width) {
  DeferredInit nothing_allocated;
  return std::make_unique<Tower>(depth, width, TensorOptions(DType::f32).device(kMeta));
}

}  // namespace zg::tasks
