#include "autograd/custom_op.h"

#include <algorithm>
#include <mutex>
#include <set>

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
    std::vector<Tensor> grads = formula(g);
    ZG_CHECK(grads.size() == metas.size(), "custom op '", name, "': backward returned ", grads.size(),
             " gradients for ", metas.size(), " inputs (one per input; an undefined Tensor for none)");
    for (size_t i = 0; i < grads.size(); ++i) {
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
