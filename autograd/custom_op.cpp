#include "autograd/custom_op.h"

#include <algorithm>
#include <mutex>
#include <set>

#include "autograd/record.h"

namespace zg {

namespace {

struct CustomNames {
  std::mutex mutex;
  std::set<std::string> names;
};
CustomNames& custom_names() {
  static CustomNames names;
  return names;
}

// What backward must return for one input: a gradient of its shape, dtype and device.
struct InputMeta {
  bool wants_grad;
  Shape shape;
  DType dtype;
  Device device;
};

// The formula's gradients; an error it raises (from an op it calls: "matmul: ...") names
// this op first, keeping its type (OutOfMemory stays OutOfMemory).
std::vector<Tensor> formula_named(const std::string& name, const Node::Backward& formula, const Tensor& g) {
  try {
    return formula(g);
  } catch (const Error& e) {
    const std::string prefix = "backward of " + name + ": ", what = e.what();
    if (what.starts_with(prefix)) throw;  // SavedTensor::get("cube") named it already
    if (dynamic_cast<const OutOfMemory*>(&e) != nullptr) throw OutOfMemory(prefix + what);
    throw Error(prefix + what);
  }
}

}  // namespace

CustomOp::CustomOp(std::string name) : name_(std::move(name)) {
  ZG_CHECK(!name_.empty(), "CustomOp: an op needs a name");
  const auto& builtin = DifferentiableOp::all();
  ZG_CHECK(std::find(builtin.begin(), builtin.end(), name_) == builtin.end(), "CustomOp: '", name_,
           "' is the name of one of zerograd's ops; choose another");
  CustomNames& registry = custom_names();
  std::lock_guard lock(registry.mutex);
  ZG_CHECK(registry.names.insert(name_).second, "CustomOp: an op named '", name_,
           "' exists already; give each op its own name (a function-local static makes one per op)");
}

Tensor CustomOp::apply(const Tensor& out, const std::vector<Tensor>& inputs, Node::Backward backward) const {
  ZG_CHECK(out.defined(), "custom op '", name_, "': the output is an undefined tensor");
  ZG_CHECK(static_cast<bool>(backward), "custom op '", name_, "': no backward formula given");
  if (!needs_grad(inputs)) return out;
  ZG_CHECK(is_floating(out.dtype()), "custom op '", name_, "': a ", describe(out),
           " output cannot carry gradients (only floating-point outputs are differentiable)");
  ZG_CHECK(!(out.is_leaf() && out.requires_grad()), "custom op '", name_,
           "': the output is a leaf that requires grad (an input or parameter itself); return a new tensor");
  std::vector<InputMeta> metas;
  for (const Tensor& x : inputs)
    metas.push_back({x.defined() && x.requires_grad(), x.defined() ? x.shape() : Shape{},
                     x.defined() ? x.dtype() : DType::f32, x.defined() ? x.device() : kCPU});
  record(out, name_, inputs, [name = name_, metas, formula = std::move(backward)](const Tensor& g) {
    std::vector<Tensor> grads = formula_named(name, formula, g);
    // (The engine holds every node, this one too, to one gradient per input.)
    for (size_t i = 0; i < std::min(grads.size(), metas.size()); ++i) {
      const InputMeta& m = metas[i];
      if (!grads[i].defined() || !m.wants_grad) continue;
      ZG_CHECK(grads[i].shape() == m.shape && grads[i].dtype() == m.dtype && grads[i].device() == m.device,
               "custom op '", name, "': backward's gradient for input ", i, " is ", describe(grads[i]),
               ", but the input was ", zg::name(m.dtype), shape_str(m.shape), " on ", m.device.str());
    }
    return grads;
  });
  return out;
}

}  // namespace zg
