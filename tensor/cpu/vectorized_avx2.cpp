// The vectorised kernels with AVX2 + FMA (compiled with -mavx2 -mfma; tensor/meson.build),
// run only where the CPU has them. Eigen gets a namespace of its own here (vectorized.h).
#define Eigen zg_eigen_avx2
#define ZG_VECTOR_ISA avx2
#include "tensor/cpu/vectorized.inc"
