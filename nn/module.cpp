#include "nn/module.h"

#include <cxxabi.h>

#include <algorithm>
#include <cstdlib>
#include <typeinfo>
#include <unordered_set>

#include "autograd/functions.h"
#include "autograd/graph.h"
#include "tensor/deferred.h"
#include "tensor/trace.h"

namespace zg::nn {

Tensor Module::forward(const Tensor&) {
  fail("forward: this module has no one-tensor forward; call its own forward method");
}

std::string Module::type_name(const std::type_info& type) {
  int status = 0;
  char* demangled = abi::__cxa_demangle(type.name(), nullptr, nullptr, &status);
  std::string name = status == 0 && demangled ? demangled : type.name();
  std::free(demangled);
  return name;
}

// What a profiler shows for a module's forward: its name in its parent and its class,
// "attn (CausalSelfAttention)"; the class alone for a module nobody registered.
std::string Module::trace_name() const {
  std::string type = type_name(typeid(*this));
  if (const size_t last = type.rfind("::"); last != std::string::npos) type = type.substr(last + 2);
  return local_name_.empty() ? type : local_name_ + " (" + type + ")";
}

Tensor Module::operator()(const Tensor& input) {
  // Named when registered; an unregistered module's name is made per call (never cached,
  // so ranks running one module on several threads never write to it).
  TraceRange range(trace_name_.empty() ? trace_name() : trace_name_);
  Tensor x = input;
  for (const auto& hook : pre_hooks_)
    if (Tensor replaced = hook(*this, x); replaced.defined()) x = replaced;
  Tensor out = forward(x);
  for (const auto& hook : post_hooks_)
    if (Tensor replaced = hook(*this, x, out); replaced.defined()) out = replaced;
  return out;
}

void Module::check_new_name(const char* op, const std::string& name) const {
  ZG_CHECK(!name.empty() && name.find('.') == std::string::npos, op, ": invalid name '", name,
           "' (names are non-empty and have no '.')");
  bool taken = false;
  for (const NamedTensors* tensors : {&parameters_, &buffers_})
    for (const auto& [existing, _] : *tensors) taken = taken || existing == name;
  for (const auto& [existing, _] : children_) taken = taken || existing == name;
  ZG_CHECK(!taken, op, ": '", name, "' is already registered (as a parameter, buffer or submodule)");
}

bool Module::contains(const Module* module) const {
  if (module == this) return true;
  for (const auto& [_, child] : children_)
    if (child->contains(module)) return true;
  return false;
}

Tensor Module::register_parameter(const std::string& name, const Tensor& value, bool requires_grad) {
  check_new_name("register_parameter", name);
  ZG_CHECK(value.defined(), "register_parameter: '", name, "' is an undefined tensor");
  // Another module's parameter is registered as itself -- one tensor, one .grad -- so
  // a weight shared by two modules stays shared (PyTorch's rule). Anything else is
  // detached into a new leaf. A deferred tensor is kept as it is: its memory category
  // is the one it is materialised in.
  const bool is_parameter = value.requires_grad() && value.is_leaf() && requires_grad &&
                            (is_deferred(value) || value.storage()->category() == MemoryCategory::parameter);
  if (is_parameter) {
    parameters_.emplace_back(name, value);
    return value;
  }
  Tensor param = value.detach();
  if (!is_deferred(param) && param.storage()->category() != MemoryCategory::parameter) {
    MemoryScope scope(MemoryCategory::parameter);
    NoGradGuard no_grad;
    param = value.clone();
  }
  if (requires_grad) param.set_requires_grad(true);
  parameters_.emplace_back(name, param);
  return param;
}

Tensor Module::register_buffer(const std::string& name, const Tensor& value) {
  check_new_name("register_buffer", name);
  ZG_CHECK(value.defined(), "register_buffer: '", name, "' is an undefined tensor");
  buffers_.emplace_back(name, value.detach());
  return buffers_.back().second;
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> module) {
  check_new_name("register_module", name);
  ZG_CHECK(module != nullptr, "register_module: '", name, "' is null");
  // A module under itself would make every walk of the tree (named_parameters...) endless.
  ZG_CHECK(!module->contains(this), "register_module: '", name,
           "' is this module or one of its ancestors; modules form a tree");
  module->local_name_ = name;
  module->trace_name_ = module->trace_name();
  // A list's items are named after the list on a timeline, "h.0 (Block)", not "0 (Block)",
  // whether the list is named before or after they join it.
  if (dynamic_cast<const ModuleList*>(this) && !local_name_.empty())
    module->trace_name_ = local_name_ + "." + module->trace_name_;
  if (dynamic_cast<const ModuleList*>(module.get()))
    for (const auto& [item, child] : module->children_) child->trace_name_ = name + "." + child->trace_name();
  children_.emplace_back(name, std::move(module));
}

void Module::collect(const std::string& prefix, bool buffers, NamedTensors& out) const {
  for (const auto& [name, t] : buffers ? buffers_ : parameters_) out.emplace_back(prefix + name, t);
  for (const auto& [name, child] : children_) child->collect(prefix + name + ".", buffers, out);
}

// A parameter registered in several modules (a shared weight) is listed once, under
// the first name the walk meets.
NamedTensors Module::named_parameters(bool remove_duplicates) const {
  NamedTensors all, out;
  collect("", false, all);
  if (!remove_duplicates) return all;
  std::unordered_set<const TensorImpl*> seen;
  for (auto& entry : all)
    if (seen.insert(&entry.second.impl()).second) out.push_back(std::move(entry));
  return out;
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (auto& [_, p] : named_parameters()) out.push_back(p);
  return out;
}

NamedTensors Module::named_buffers() const {
  NamedTensors out;
  collect("", true, out);
  return out;
}

void Module::set_split(const std::string& parameter, TensorSplit split) {
  const bool known = std::any_of(parameters_.begin(), parameters_.end(), [&](const auto& p) { return p.first == parameter; });
  ZG_CHECK(known, "set_split: this module has no parameter '", parameter, "'");
  std::erase_if(splits_, [&](const auto& s) { return s.first == parameter; });
  splits_.emplace_back(parameter, split);
}

std::vector<std::pair<std::string, TensorSplit>> Module::named_splits() const {
  std::vector<std::pair<std::string, TensorSplit>> out = splits_;
  for (const auto& [name, child] : children_)
    for (auto [path, split] : child->named_splits()) out.emplace_back(name + "." + path, split);
  return out;
}

std::vector<std::pair<std::string, Module*>> Module::named_modules() {
  std::vector<std::pair<std::string, Module*>> out{{"", this}};
  for (const auto& [name, child] : children_)
    for (const auto& [path, m] : child->named_modules()) out.emplace_back(path.empty() ? name : name + "." + path, m);
  return out;
}

void Module::train(bool training) {
  training_ = training;
  for (auto& [_, child] : children_) child->train(training);
}

void Module::apply(const std::function<void(const std::string&, Module&)>& fn) {
  for (auto& [path, m] : named_modules()) fn(path, *m);
}

void Module::convert(const std::function<Tensor(const Tensor&)>& fn) {
  for (const auto& [name, p] : named_parameters())
    if (const ParameterOwner* owner = ParameterOwner::of(p))
      fail("to: parameter '", name, "' lives in the flat buffers of ", owner->describe(),
           ", which would not follow it; move or convert the model before building that");
  NoGradGuard no_grad;
  for (auto& [_, p] : named_parameters()) {  // a shared parameter once: its handles all see the new data
    MemoryScope scope(MemoryCategory::parameter);
    p.set_data(fn(p.detach()));
  }
  for (auto& [_, m] : named_modules())
    for (auto& [name, b] : m->buffers_) b.set_data(fn(b.detach()));
}

// A deferred tensor stays deferred: only its recipe's target changes.
void Module::to(Device device) {
  convert([device](const Tensor& t) {
    return is_deferred(t) ? deferred_to(t, TensorOptions(t.dtype()).device(device)) : t.to(device);
  });
}

void Module::to(DType dtype) {
  ZG_CHECK(is_floating(dtype), "to: modules convert to floating dtypes only, got ", name(dtype));
  convert([dtype](const Tensor& t) {
    if (!is_floating(t.dtype())) return t;
    return is_deferred(t) ? deferred_to(t, TensorOptions(dtype).device(t.device())) : t.to(dtype);
  });
}

// A parameter in flat buffers (a ShardedModel's) keeps its .grad view: its
// owner zeroes its whole gradient buffer, so this module must hold all of the owner's
// parameters, not a part of them.
void Module::zero_grad() {
  std::vector<Tensor> unowned;
  std::vector<std::pair<ParameterOwner*, int64_t>> owners;  // each with how many of its parameters are here
  for (const Tensor& p : parameters()) {
    ParameterOwner* owner = ParameterOwner::of(p);
    if (owner == nullptr) {
      unowned.push_back(p);
      continue;
    }
    auto seen = std::find_if(owners.begin(), owners.end(), [&](const auto& o) { return o.first == owner; });
    if (seen == owners.end()) owners.emplace_back(owner, 1);
    else ++seen->second;
  }
  for (const auto& [owner, count] : owners)
    ZG_CHECK(count == owner->num_owned(), "zero_grad: this module has ", count, " of the ", owner->num_owned(),
             " parameters in the flat buffers of ", owner->describe(), ", which are zeroed whole; call zero_grad() on "
             "the model it was built on");
  for (const Tensor& p : unowned) p.set_grad(Tensor());
  for (const auto& [owner, _] : owners) owner->zero_grad();
}

// Each handle keeps its identity (set_data), so tied weights stay tied and hooks stay on.
void materialize(Module& module) {
  for (const auto& [_, p] : module.named_parameters()) {
    if (!is_deferred(p)) continue;
    MemoryScope scope(MemoryCategory::parameter);
    p.set_data(zg::materialize(p));
  }
  for (const auto& [_, b] : module.named_buffers())
    if (is_deferred(b)) b.set_data(zg::materialize(b));
}

}  // namespace zg::nn
