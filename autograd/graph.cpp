#include "autograd/graph.h"

#include <atomic>

#include "autograd/functions.h"
#include "autograd/record.h"
#include "tensor/backend.h"
#include "tensor/checks.h"

namespace zg {

namespace {
thread_local bool grad_mode_enabled = true;

AutogradMeta& meta_of(const Tensor& t) {
  auto& meta = t.impl().autograd;
  if (!meta) meta = std::make_shared<AutogradMeta>();
  return *meta;
}

std::shared_ptr<AccumulateGrad> accumulator_of(const Tensor& leaf) {
  AutogradMeta& meta = meta_of(leaf);
  std::shared_ptr<AccumulateGrad> acc = meta.grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(leaf.impl_ptr());
    meta.grad_accumulator = acc;
  }
  return acc;
}
}  // namespace

bool GradMode::is_enabled() { return grad_mode_enabled; }
void GradMode::set_enabled(bool enabled) { grad_mode_enabled = enabled; }

namespace {
thread_local bool offloading_saved = false;

// `src` into `dst` on another device (or allocator), through the backend that can reach both.
void copy_across(const Tensor& src, const Tensor& dst) {
  backend(dst.device().type == DeviceType::cpu ? src.device() : dst.device()).copy(src, dst);
}
}  // namespace

OffloadSavedTensors::OffloadSavedTensors() : previous_(offloading_saved) { offloading_saved = true; }
OffloadSavedTensors::~OffloadSavedTensors() { offloading_saved = previous_; }
bool OffloadSavedTensors::active() { return offloading_saved; }

SavedTensor::SavedTensor(const Tensor& t) : version_(t.defined() ? t.storage()->version() : 0) {
  const MemoryCategory category = t.defined() ? t.storage()->category() : MemoryCategory::other;
  if (!offloading_saved || !t.defined() || t.storage()->is_released() ||
      (category != MemoryCategory::activation && category != MemoryCategory::other)) {
    tensor_ = t.defined() ? t.detach() : t;
    return;
  }
  MemoryScope scope(MemoryCategory::activation);
  host_ = empty(t.shape(), TensorOptions(t.dtype()).device(t.device().type == DeviceType::meta ? kMeta : kCPU)
                               .pinned(true));
  copy_across(t, host_);
  device_ = t.device();
  original_ = t.storage();
}

Tensor SavedTensor::get(const std::string& op) const {
  const std::shared_ptr<Storage> original = original_.lock();  // (offloaded, and still alive)
  const uint64_t now = tensor_.defined() && !host_.defined() ? tensor_.storage()->version()
                       : original                             ? original->version()
                                                              : version_;
  if (now != version_)
    fail("backward of ", op, ": a tensor saved for it (", describe(host_.defined() ? host_ : tensor_),
         ") was modified in place after it was saved (version ", version_, " -> ", now,
         "); clone it before modifying it");
  if (host_.defined() && !tensor_.defined()) {  // back to its device, once
    MemoryScope scope(MemoryCategory::activation);
    tensor_ = empty(host_.shape(), TensorOptions(host_.dtype()).device(device_));
    copy_across(host_, tensor_);
  }
  return tensor_;
}

Tensor SavedTensor::get_for_overwrite(const std::string& op) const {
  const Tensor t = get(op);
  // The saved tensor's own handles are tensor_ and `t`; any other handle (a gradient a
  // formula returned), view or saved copy of the storage holds one more reference. The
  // library keeps no weak reference to a detached tensor or its storage, so none appears meanwhile.
  if (!t.defined() || !last_use_of_saved_tensors() || t.use_count() != 2 || t.storage().use_count() != 1)
    return {};
  t.storage()->bump_version();
  return t;
}

std::vector<Tensor> Node::apply(const Tensor& grad) {
  ZG_CHECK(backward_ != nullptr, "backward: the graph through ", name_,
           " was freed by an earlier backward(); pass retain_graph=true to go through it twice");
  return backward_(grad);
}

void Node::release() { backward_ = nullptr; }

// A node owns the next nodes through its edges, and older nodes through the tensors its
// formula saved: freed recursively, a chain of a million ops (an unrolled RNN, an
// iterative solver) would nest a million destructors and overflow the stack. So the
// outermost ~Node on a thread frees iteratively: a node destroyed inside it (its last
// owner being what an outer node held) hands what it owns to the outermost one's list
// instead of freeing it then, and the outermost one frees the list item by item. The
// nesting stays a handful of frames deep whatever the graph's depth.
Node::~Node() {
  struct Owned {
    std::vector<Edge> next;
    Backward backward;
    std::vector<std::function<Tensor(const Tensor&)>> hooks;
  };
  thread_local std::vector<Owned>* outermost = nullptr;
  Owned mine{std::move(next_), std::move(backward_), std::move(pre_hooks)};
  if (outermost) {
    outermost->push_back(std::move(mine));
    return;
  }
  std::vector<Owned> pending;
  outermost = &pending;
  pending.push_back(std::move(mine));
  while (!pending.empty()) {
    Owned item = std::move(pending.back());
    pending.pop_back();
  }  // `item` is freed here; nodes it owned last push onto `pending`
  outermost = nullptr;
}

namespace {
std::atomic<uint64_t> node_count{0};
}
uint64_t Node::take_sequence_nr() { return node_count.fetch_add(1, std::memory_order_relaxed); }
uint64_t Node::next_sequence_nr() { return node_count.load(std::memory_order_relaxed); }

std::vector<Tensor> AccumulateGrad::apply(const Tensor& grad) {
  const std::shared_ptr<TensorImpl> impl = leaf_.lock();
  if (!impl) return {};  // the leaf no longer exists: nothing to accumulate into
  const Tensor leaf(impl);
  AutogradMeta& meta = meta_of(leaf);
  const Tensor g = meta.hooks.empty() ? grad : run_tensor_hooks(meta.hooks, grad, "a leaf " + describe(leaf));
  // The gradient has the leaf's kind as the graph recorded it; set_data since then may
  // have changed the leaf (copy_ would broadcast or cast the gradient into it).
  ZG_CHECK(g.shape() == leaf.shape() && g.dtype() == leaf.dtype() && g.device() == leaf.device(),
           "backward: the gradient ", describe(g), " does not fit the leaf ", describe(leaf),
           ": its data was replaced (set_data) after the graph through it was recorded");
  if (meta.grad.defined()) {
    meta.grad.add_(g);  // in place: a .grad that is a view into a flat buffer stays one
  } else {
    MemoryScope scope(MemoryCategory::gradient);
    meta.grad = empty_like(leaf);
    meta.grad.copy_(g);
  }
  for (const auto& hook : meta.post_accumulate_hooks) hook(leaf);
  return {};
}

Tensor run_tensor_hooks(const std::vector<std::function<Tensor(const Tensor&)>>& hooks, Tensor grad,
                        const std::string& where) {
  for (const auto& hook : hooks) {
    Tensor replaced = hook(grad);
    if (!replaced.defined()) continue;
    ZG_CHECK(replaced.shape() == grad.shape() && replaced.dtype() == grad.dtype() && replaced.device() == grad.device(),
             "backward: a tensor hook on ", where, " returned ", describe(replaced), " for the gradient ",
             describe(grad), "; a hook returns a tensor of the gradient's shape, dtype and device, or none");
    grad = std::move(replaced);
  }
  return grad;
}

namespace {
std::vector<std::string>& op_registry() {
  static std::vector<std::string> names;
  return names;
}
}  // namespace

DifferentiableOp::DifferentiableOp(const char* name) : name_(name) { op_registry().emplace_back(name); }
const std::vector<std::string>& DifferentiableOp::all() { return op_registry(); }

std::shared_ptr<Node> gradient_edge(const Tensor& t) {
  if (auto fn = t.grad_fn()) return fn;
  return accumulator_of(t);
}

bool needs_grad(std::initializer_list<const Tensor*> inputs) {
  if (!GradMode::is_enabled()) return false;
  for (const Tensor* t : inputs)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

bool needs_grad(const std::vector<Tensor>& inputs) {
  if (!GradMode::is_enabled()) return false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

void record(const Tensor& out, const DifferentiableOp& op, const std::vector<Tensor>& inputs,
            Node::Backward backward) {
  record(out, std::string(op.name()), inputs, std::move(backward));
}

void record(const Tensor& out, std::string name, const std::vector<Tensor>& inputs, Node::Backward backward) {
  // Only floating-point results are differentiable (PyTorch's rule): a cast to an
  // integer type or bool starts no gradient path -- its gradient would be zero, not the
  // incoming one passed back as if the rounding were the identity.
  if (!is_floating(out.dtype())) return;
  std::vector<Edge> edges;
  edges.reserve(inputs.size());
  for (const Tensor& input : inputs) {
    if (!input.defined() || !input.requires_grad()) edges.emplace_back();
    else edges.emplace_back(gradient_edge(input), input);
  }
  AutogradMeta& meta = meta_of(out);
  meta.requires_grad = true;
  meta.grad_fn = std::make_shared<Node>(std::move(name), std::move(edges), std::move(backward));
}

Tensor differentiable(const Tensor& out, const DifferentiableOp& op, const std::vector<Tensor>& inputs,
                      Node::Backward backward) {
  if (needs_grad(inputs)) record(out, op, inputs, std::move(backward));
  return out;
}

Tensor sum_to(const Tensor& grad, const Shape& shape) {
  if (grad.shape() == shape) return grad;
  const int64_t lead = grad.dim() - static_cast<int64_t>(shape.size());
  Shape dims;
  for (int64_t d = 0; d < grad.dim(); ++d)
    if (d < lead || (shape[d - lead] == 1 && grad.shape()[d] != 1)) dims.push_back(d);
  return dims.empty() ? grad.reshape(shape) : sum(grad, dims, true).reshape(shape);
}

// ---- Tensor's autograd methods ----

bool Tensor::requires_grad() const { return impl().autograd && impl().autograd->requires_grad; }

Tensor& Tensor::set_requires_grad(bool requires_grad) {
  ZG_CHECK(is_leaf(), "set_requires_grad: only leaf tensors can be set; ", describe(*this),
           " is the output of ", grad_fn()->name(), " (use detach() for a new leaf)");
  ZG_CHECK(!requires_grad || is_floating(dtype()), "set_requires_grad: only floating-point tensors can require grad, got ",
           describe(*this));
  // An optimizer over flat buffers updates every element of its spans, gradient or not:
  // a parameter frozen there would go on moving (weight decay, momentum), silently.
  if (const ParameterOwner* owner = requires_grad ? nullptr : ParameterOwner::of(*this))
    fail("set_requires_grad: ", describe(*this), " is a parameter in the flat buffers of ", owner->describe(),
         ", which trains every parameter it holds; freeze parameters before packing them, and pack only the "
         "trainable ones");
  meta_of(*this).requires_grad = requires_grad;
  return *this;
}

bool Tensor::is_leaf() const { return !impl().autograd || !impl().autograd->grad_fn; }

Tensor Tensor::grad() const { return impl().autograd ? impl().autograd->grad : Tensor(); }

void Tensor::retain_grad() const {
  ZG_CHECK(requires_grad(), "retain_grad: ", describe(*this), " does not require grad");
  if (!is_leaf()) grad_fn()->retained_output = impl().autograd;
}

bool Tensor::retains_grad() const { return !is_leaf() && grad_fn()->retained_output.lock() == impl().autograd; }

namespace {

// Refuses to repoint a parameter that lives in a ParameterOwner's buffers.
void check_not_owned(const Tensor& t, const char* op) {
  if (const ParameterOwner* owner = ParameterOwner::of(t))
    fail(op, ": ", describe(t), " is a parameter in the flat buffers of ", owner->describe(),
         " (its data and .grad are views into them); repointing it would detach it from what the "
         "optimizer updates. Zero gradients with zero_grad() on the model or on the owner");
}

}  // namespace

ParameterOwner* ParameterOwner::of(const Tensor& param) {
  return param.defined() && param.impl().autograd ? param.impl().autograd->owner.lock().get() : nullptr;
}

void ParameterOwner::own(const Tensor& param) {
  meta_of(param).owner = alive_;
  ++owned_;
}

void ParameterOwner::point_data(const Tensor& param, const Tensor& data) { param.set_data_unchecked(data); }

void ParameterOwner::point_grad(const Tensor& param, const Tensor& grad) { param.set_grad_unchecked(grad); }

void Tensor::set_grad(const Tensor& grad) const {
  check_not_owned(*this, "set_grad");
  set_grad_unchecked(grad);
}

void Tensor::set_grad_unchecked(const Tensor& grad) const {
  if (grad.defined()) {
    ZG_CHECK(grad.shape() == shape() && grad.dtype() == dtype() && grad.device() == device(),
             "set_grad: gradient ", describe(grad), " does not match the tensor ", describe(*this));
    detail::check_no_broadcast_dims("set_grad", "gradient", grad);  // backward accumulates into it
  }
  meta_of(*this).grad = grad;
}

std::shared_ptr<Node> Tensor::grad_fn() const { return impl().autograd ? impl().autograd->grad_fn : nullptr; }

Tensor Tensor::detach() const {
  auto impl = std::make_shared<TensorImpl>(this->impl());
  impl->autograd = nullptr;
  return Tensor(std::move(impl));
}

void Tensor::register_hook(std::function<Tensor(const Tensor&)> fn) const {
  ZG_CHECK(requires_grad(), "register_hook: ", describe(*this), " does not require grad");
  if (auto node = grad_fn()) node->pre_hooks.push_back(std::move(fn));
  else meta_of(*this).hooks.push_back(std::move(fn));
}

void Tensor::register_post_accumulate_grad_hook(std::function<void(const Tensor&)> fn) const {
  ZG_CHECK(requires_grad() && is_leaf(), "register_post_accumulate_grad_hook: ", describe(*this),
           " is not a leaf that requires grad");
  meta_of(*this).post_accumulate_hooks.push_back(std::move(fn));
}

void Tensor::set_data(const Tensor& source) const {
  check_not_owned(*this, "set_data");
  set_data_unchecked(source);
}

void Tensor::set_data_unchecked(const Tensor& source) const {
  ZG_CHECK(source.defined(), "set_data: got an undefined tensor for ", describe(*this));
  ZG_CHECK(!requires_grad() || is_floating(source.dtype()), "set_data: ", describe(*this),
           " requires grad, so its data must be floating-point, not ", describe(source));
  TensorImpl& self = impl();
  const bool same_kind = source.shape() == self.shape && source.dtype() == self.dtype &&
                         source.device() == self.storage->device();
  self.storage = source.storage();
  self.offset = source.offset();
  self.shape = source.shape();
  self.strides = source.strides();
  self.dtype = source.dtype();
  if (!same_kind && self.autograd) self.autograd->grad = Tensor();  // a gradient of the old kind no longer fits
}

}  // namespace zg
