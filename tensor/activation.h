// The activations a fused linear layer can apply in its epilogue. Its own header
// so that the backend interface (and every CUDA kernel file under it) names it
// without pulling in the op front-ends, whose zg::sqrt(Tensor) and zg::pow(Tensor)
// would hide the device math functions of the same names.
#pragma once

#include <cstdint>

namespace zg {

enum class Activation : uint8_t { none, gelu };  // gelu: GPT-2's tanh form

}  // namespace zg
