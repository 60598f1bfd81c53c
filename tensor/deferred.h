// Deferred initialisation: building a model without allocating it. Under a
// DeferredInit scope the factories (empty, zeros, ones, full, rand, randn, uniform,
// normal and their *_like) take no memory: each returns a tensor of the asked shape,
// dtype and device whose storage holds, instead of bytes, the recipe of its values --
// a constant, or the Philox stream position the eager op would have drawn from (the
// generator's blocks are reserved exactly as the eager op reserves them, so a deferred
// build gives every tensor the numbers an eager build gives it). Element i depends only
// on the recipe and i, so a tensor can be materialised a slice at a time into buffers
// the caller owns -- a sharded model fills only each rank's shard -- or whole. Until
// then every op that would read or write its values throws, naming the op.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace zg {

// Makes this thread's factories deferred for a scope (nested scopes restore the outer
// state). Only the factories are: run nothing under it but construction, since an op
// that makes a temporary with a factory would get a deferred one and throw.
class DeferredInit {
 public:
  DeferredInit();
  ~DeferredInit();
  DeferredInit(const DeferredInit&) = delete;
  DeferredInit& operator=(const DeferredInit&) = delete;
  static bool is_active();

 private:
  bool previous_;
};

struct InitRecipe;  // how a deferred tensor's values are made (tensor/init_recipe.h)

bool is_deferred(const Tensor& t);

// Writes elements [begin, begin + out.numel()) of the row-major initial values of a
// contiguous deferred tensor into `out`: contiguous, not deferred, on any device, in
// the tensor's dtype or -- for a floating tensor -- any floating dtype. The values are
// the tensor's own (a bf16 tensor's, widened into an f32 out); in its own dtype they are
// generated directly into out, with no temporary.
void materialize_range(const Tensor& deferred, int64_t begin, const Tensor& out);
// The whole tensor, in a new storage of the current memory category.
Tensor materialize(const Tensor& deferred);

// The slice of a deferred tensor that tensor parallelism cuts (tensor/slice_index.h):
// along `dim`, in `chunks` equal blocks, part `part` of `parts` of each; still deferred,
// its values the whole tensor's there. A slice is not cut again.
Tensor deferred_slice(const Tensor& deferred, int64_t dim, int64_t chunks, int parts, int part);

// The same values on another device or in another dtype, still deferred: what Module::to
// does to a deferred model. A tensor may change dtype once before it is materialised
// (as an eager one would be rounded once).
Tensor deferred_to(const Tensor& deferred, TensorOptions options);

// Throws zg::Error naming `op` and `t` when t is deferred; the op front-ends call it.
void check_materialized(const char* op, const Tensor& t);

// The tensor a factory returns under DeferredInit (tensor/tensor.cpp).
Tensor deferred_tensor(const Shape& shape, TensorOptions options, const InitRecipe& recipe);

}  // namespace zg
