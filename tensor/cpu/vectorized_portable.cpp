// The vectorised kernels for any CPU: the library's own compiler flags.
#define ZG_VECTOR_ISA portable
#include "tensor/cpu/vectorized.inc"
