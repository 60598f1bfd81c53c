// Module: the base of every layer and model, as in libtorch's C++ frontend.
// A module owns named parameters, buffers and submodules; named_parameters()
// walks them recursively with dotted names ("transformer.h.0.attn.c_attn.weight"),
// in registration order, which is also the order the dist layer packs them in.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "nn/parallel_plan.h"
#include "nn/unit_plan.h"
#include "tensor/tensor.h"

namespace zg::nn {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

class Module {
 public:
  virtual ~Module() = default;

  // The one-tensor forward of layers and blocks. Call it through operator(), which
  // runs the forward pre-hooks and hooks around it (ZeRO-3 gathers a unit there).
  virtual Tensor forward(const Tensor& input);
  // How its parameters split into units (nn/unit_plan.h) when a ShardedModel holds
  // them. The default: one root unit.
  virtual UnitPlan unit_plan() const { return {}; }
  // How dist::parallelize_module cuts it across a tensor-parallel group (nn/parallel_plan.h).
  // The default: no plan (parallelize_module then asks for one).
  virtual ParallelPlan parallel_plan() const { return {}; }
  Tensor operator()(const Tensor& input);

  // A parameter is stored as given, in the `parameter` memory category (a tensor
  // made outside that category is copied into it; a deferred one is kept, and takes
  // the category when it is materialised) and set to require grad. Another
  // module's parameter is registered as that same tensor: a shared (tied) weight.
  Tensor register_parameter(const std::string& name, const Tensor& value, bool requires_grad = true);
  Tensor register_buffer(const std::string& name, const Tensor& value);
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    add_child(name, module);
    return module;
  }

  // A shared parameter (registered in several modules) once, under its first name; with
  // remove_duplicates false, under every name it has.
  NamedTensors named_parameters(bool remove_duplicates = true) const;
  std::vector<Tensor> parameters() const;
  NamedTensors named_buffers() const;
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& named_children() const { return children_; }
  // This module and every descendant with its dotted path ("" for this one).
  std::vector<std::pair<std::string, Module*>> named_modules();

  void train(bool training = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // Moves or converts every parameter and buffer in place: the Tensor handles held
  // elsewhere (a hook) see the new data. to(dtype) converts floating tensors only.
  // A deferred model (tensor/deferred.h) stays deferred, its tensors retargeted.
  // A parameter whose device or dtype changes drops its .grad (set_data: a gradient of
  // the old kind no longer fits); PyTorch's converts it along.
  // Refused once the parameters live in a ShardedModel's buffers.
  void to(Device device);
  void to(DType dtype);
  void apply(const std::function<void(const std::string& path, Module& module)>& fn);
  // Drops every parameter's .grad -- or, for parameters in the flat buffers of a
  // ShardedModel, has that owner zero its gradients (the views stay).
  void zero_grad();

  using ForwardPreHook = std::function<Tensor(Module&, const Tensor& input)>;  // defined result replaces input
  using ForwardHook = std::function<Tensor(Module&, const Tensor& input, const Tensor& output)>;  // ... output
  void register_forward_pre_hook(ForwardPreHook hook) { pre_hooks_.push_back(std::move(hook)); }
  void register_forward_hook(ForwardHook hook) { post_hooks_.push_back(std::move(hook)); }

  // Tensor parallelism's record of how each parameter was cut (set by
  // dist::parallelize_module): by dotted name, a shared parameter under each of its names.
  void set_split(const std::string& parameter, TensorSplit split);  // a parameter of this module
  std::vector<std::pair<std::string, TensorSplit>> named_splits() const;

 protected:
  // A class's name as C++ spells it ("zg::nn::Block"), for messages.
  static std::string type_name(const std::type_info& type);

 private:
  void add_child(const std::string& name, std::shared_ptr<Module> module);
  // A name for a new parameter, buffer or submodule: non-empty, no '.', not taken by any
  // of the three (the dotted names of named_parameters() must be unambiguous).
  void check_new_name(const char* op, const std::string& name) const;
  bool contains(const Module* module) const;  // this module or one below it
  void collect(const std::string& prefix, bool buffers, NamedTensors& out) const;
  std::string trace_name() const;
  void convert(const std::function<Tensor(const Tensor&)>& fn);

  NamedTensors parameters_, buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  std::vector<ForwardPreHook> pre_hooks_;
  std::vector<ForwardHook> post_hooks_;
  std::vector<std::pair<std::string, TensorSplit>> splits_;
  bool training_ = true;
  std::string local_name_;  // the name its parent registered it under ("attn", "0")
  std::string trace_name_;  // its profiler range's name, made when it is registered
};

// Gives every deferred parameter and buffer of `module` (tensor/deferred.h) its values,
// whole and in place: parameters in the `parameter` memory category, buffers in the
// current one. The one-rank path; a sharded model materialises each rank's slice instead.
void materialize(Module& module);

// A list of modules named "0", "1", ... (transformer.h.0, transformer.h.1, ...).
class ModuleList : public Module {
 public:
  template <class M>
  std::shared_ptr<M> push_back(std::shared_ptr<M> module) {
    std::shared_ptr<M> registered = register_module(std::to_string(items_.size()), std::move(module));
    items_.push_back(registered);
    return registered;
  }
  size_t size() const { return items_.size(); }
  Module& operator[](size_t i) const { return *item("ModuleList", i); }
  // Item i as its own class, as libtorch's at<T> and ptr<T>: `h->at<Block>(0).attn`
  // without a dynamic_cast. An item that is not an M (or of a class derived from M) is
  // an error, as is an index out of range.
  template <class M>
  M& at(size_t i) const { return *typed<M>("ModuleList::at", i); }
  template <class M>
  std::shared_ptr<M> ptr(size_t i) const { return typed<M>("ModuleList::ptr", i); }

 private:
  const std::shared_ptr<Module>& item(const char* op, size_t i) const {
    ZG_CHECK(i < items_.size(), op, ": index ", i, " is out of range for a list of ", items_.size());
    return items_[i];
  }
  template <class M>
  std::shared_ptr<M> typed(const char* op, size_t i) const {
    const std::shared_ptr<Module>& module = item(op, i);
    std::shared_ptr<M> cast = std::dynamic_pointer_cast<M>(module);
    const Module& actual = *module;
    ZG_CHECK(cast != nullptr, op, ": item ", i, " of a list of ", items_.size(), " is a ", type_name(typeid(actual)),
             ", not a ", type_name(typeid(M)));
    return cast;
  }

  std::vector<std::shared_ptr<Module>> items_;
};

}  // namespace zg::nn
