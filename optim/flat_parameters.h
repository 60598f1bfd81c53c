// FlatParameters: a model's parameters packed into flat buffers, one per role.
//
//   compute [n]  the weights the model computes with (f32, bf16 or f16); every
//                parameter tensor becomes a view into it          -> `parameter`
//   grad    [n]  same dtype; every parameter's .grad is a view into it, so
//                backward accumulates straight into one buffer    -> `gradient`
//   master  [n]  f32 weights the optimizer updates (f64 when training in f64); when the
//                compute dtype is the master's it *is* the compute buffer, otherwise a
//                separate copy                                    -> `optimizer_state`
//
// Parameters that get weight decay (rank >= 2: matrices and embeddings) come first
// and the rest (biases, norms) after, so each group is one contiguous span. The
// optimizer never sees a parameter tensor: it updates spans of these buffers,
// which is what lets the dist layer hand it only a shard. While it lives it is the
// parameters' ParameterOwner (autograd/graph.h): Module::zero_grad() zeroes `grad`,
// and repointing a parameter (set_data, Module::to) is refused.
#pragma once

#include <string>
#include <vector>

#include "autograd/graph.h"
#include "nn/module.h"

namespace zg::optim {

// The dtype of master weights and Adam state: f32, or f64 for f64 training.
DType master_dtype_for(DType compute_dtype);

// What packing parameters into flat buffers needs of them, checked by FlatParameters and
// the dist layer's ShardedModel (`who` names the caller in the error): at least one,
// each floating and trainable (requires grad), all on one device, none already packed by
// another live owner, and no two sharing memory. (A weight registered in two modules
// is one parameter, listed once by named_parameters; two different tensors over one
// storage -- a list naming one twice, views of one tensor -- would be untied by packing,
// so they are refused.)
void check_packable(const char* who, const nn::NamedTensors& parameters);

class FlatParameters final : public ParameterOwner {
 public:
  struct Entry {
    std::string name;
    Tensor param;    // the module's parameter, now a view into `compute`
    int64_t offset;  // in elements, into every buffer
    Shape shape;
  };
  struct Span {
    int64_t offset, length;
    bool weight_decay;
  };

  // Takes the module's parameters (any floating dtype; their values become the f32 master).
  FlatParameters(const nn::NamedTensors& parameters, DType compute_dtype);

  Tensor compute, grad, master;
  std::vector<Entry> entries;
  std::vector<Span> spans;  // [decay, no decay]
  int64_t numel() const { return compute.numel(); }
  DType compute_dtype() const { return compute.dtype(); }

  std::string describe() const override { return "a FlatParameters"; }
  void zero_grad() override;
  // After changing `master` (a loaded checkpoint), refresh the compute copy.
  void sync_compute_from_master();
  // With a separate compute copy (16-bit compute), an update rewrites every compute weight
  // from the master, so a write to a parameter since the last one (fill_, copy_, an init,
  // on it or on a view) would be lost without a word. The optimizers call this first: such
  // a write -- seen in the compute buffer's version, which every in-place write bumps -- is
  // an error naming `who`. They call mark_compute_current() after their own writes.
  void check_compute_unwritten(const char* who) const;
  void mark_compute_current();
  // The slice of a flat buffer that belongs to one entry, shaped like the parameter.
  static Tensor view_of(const Tensor& flat, const Entry& entry);

 private:
  uint64_t compute_version_ = 0;  // the compute buffer's version after the last write of ours
};

}  // namespace zg::optim
