#include "optim/flat_parameters.h"

#include <set>

#include "autograd/functions.h"
#include "autograd/graph.h"

namespace zg::optim {

DType master_dtype_for(DType compute_dtype) { return accumulate_type(compute_dtype); }

void check_packable(const char* who, const nn::NamedTensors& parameters) {
  ZG_CHECK(!parameters.empty(), who, ": no parameters");
  for (const auto& [name, p] : parameters) ZG_CHECK(p.defined(), who, ": parameter '", name, "' is undefined");
  const Device device = parameters.front().second.device();
  std::set<std::string> names;
  for (size_t i = 0; i < parameters.size(); ++i) {
    const auto& [name, p] = parameters[i];
    ZG_CHECK(names.insert(name).second, who, ": two parameters are named '", name,
             "' (a checkpoint names each parameter)");
    ZG_CHECK(is_floating(p.dtype()), who, ": parameter '", name, "' is ", describe(p),
             "; only floating parameters are trained");
    ZG_CHECK(p.device() == device, who, ": parameter '", name, "' is on ", p.device().str(), ", '",
             parameters.front().first, "' on ", device.str());
    // Every element of a flat span is updated (weight decay, momentum), gradient or not.
    ZG_CHECK(p.requires_grad(), who, ": parameter '", name, "' does not require grad (frozen); every parameter in "
             "flat buffers is trained, so pack only the trainable ones (named_parameters() filtered by requires_grad())");
    // Its gradient would go to the tensors it was computed from, never to its flat slice.
    ZG_CHECK(p.is_leaf(), who, ": parameter '", name, "' is the output of ", p.grad_fn()->name(),
             ", not a leaf; a parameter is a leaf tensor (PyTorch: can't optimize a non-leaf Tensor)");
    if (const ParameterOwner* owner = ParameterOwner::of(p))
      fail(who, ": parameter '", name, "' already lives in the flat buffers of ", owner->describe());
    if (p.numel() == 0) continue;
    const auto [first, last] = storage_range(p);
    for (size_t j = 0; j < i; ++j) {
      const auto& [other_name, other] = parameters[j];
      if (other.numel() == 0 || other.storage() != p.storage()) continue;
      const auto [other_first, other_last] = storage_range(other);
      ZG_CHECK(last <= other_first || other_last <= first, who, ": parameters '", other_name, "' and '", name,
               "' share memory; packing would give each its own copy. A shared weight is one tensor: register "
               "that tensor in both modules, or use it in both places");
    }
  }
}

Tensor FlatParameters::view_of(const Tensor& flat, const Entry& entry) {
  return flat.narrow(0, entry.offset, zg::numel(entry.shape)).view(entry.shape);
}

FlatParameters::FlatParameters(const nn::NamedTensors& parameters, DType compute_dtype) {
  ZG_CHECK(is_floating(compute_dtype), "FlatParameters: compute dtype must be floating, got ", name(compute_dtype));
  check_packable("FlatParameters", parameters);
  const Device device = parameters.front().second.device();
  // Decayed parameters first, then the others: two contiguous spans.
  int64_t total = 0;
  for (bool decay : {true, false}) {
    const int64_t start = total;
    for (const auto& [name, p] : parameters) {
      if ((p.dim() >= 2) != decay) continue;
      entries.push_back({name, p, total, p.shape()});
      total += p.numel();
    }
    spans.push_back({start, total - start, decay});
  }

  NoGradGuard no_grad;
  const DType master_dtype = master_dtype_for(compute_dtype);
  const bool separate_master = compute_dtype != master_dtype;
  {
    MemoryScope scope(separate_master ? MemoryCategory::optimizer_state : MemoryCategory::parameter);
    master = empty({total}, TensorOptions(master_dtype).device(device));
  }
  for (const Entry& e : entries) view_of(master, e).copy_(e.param);
  if (separate_master) {
    MemoryScope scope(MemoryCategory::parameter);
    compute = master.to(compute_dtype);
  } else {
    compute = master;
  }
  {
    MemoryScope scope(MemoryCategory::gradient);
    grad = zeros({total}, TensorOptions(compute_dtype).device(device));
  }
  for (const Entry& e : entries) {
    point_data(e.param, view_of(compute, e));
    point_grad(e.param, view_of(grad, e));
    own(e.param);
  }
  mark_compute_current();
}

void FlatParameters::check_compute_unwritten(const char* who) const {
  ZG_CHECK(compute.is_same(master) || compute.storage()->version() == compute_version_, who, ": the ",
           name(compute.dtype()), " compute weights were written since the last update (an in-place write to a "
           "parameter: fill_, copy_, an init), and the update rewrites them from the ", name(master.dtype()),
           " master weights, so that write would be lost. Write the master instead (FlatParameters::view_of(master, "
           "entry)), then call sync_compute_from_master()");
}

void FlatParameters::mark_compute_current() { compute_version_ = compute.storage()->version(); }

void FlatParameters::zero_grad() {
  NoGradGuard no_grad;
  grad.zero_();
}

void FlatParameters::sync_compute_from_master() {
  if (compute.is_same(master)) return;
  NoGradGuard no_grad;
  compute.copy_(master);
  mark_compute_current();
}

}  // namespace zg::optim
