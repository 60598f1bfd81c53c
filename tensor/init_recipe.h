// A deferred tensor's recipe (tensor/deferred.h): what its factory would have
// written. Internal: the factories and materialize_range read it.
#pragma once

#include "tensor/backend.h"
#include "tensor/slice_index.h"

namespace zg {

// What a factory would have written. The values are made in `dtype` and then
// converted to the tensor's (which differs after a Module::to of a deferred model).
struct InitRecipe {
  enum class Kind : uint8_t { undefined, constant, random };
  Kind kind = Kind::undefined;  // undefined: empty(), whose contents are anything
  DType dtype = DType::f32;
  double value = 0;   // constant
  RandomSpec random;  // random: distribution, a, b, seed, and the stream position of element 0
  // A slice of the tensor the factory made (tensor parallelism's cut of a deferred model):
  // element i is the whole tensor's at position `slice_start` + i of `cut` (parts > 1).
  SliceIndex cut;
  int64_t slice_start = 0;
};

}  // namespace zg
