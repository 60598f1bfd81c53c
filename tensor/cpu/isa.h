// The widest x86 vector extension the CPU backend's kernels use. The library is built
// for portable x86-64 (SSE2); the kernels that pay for wider vectors -- AdamW's loops,
// the Eigen GEMMs, attention and GELU (vectorized.h) -- carry AVX2 + FMA (and AdamW AVX-512)
// builds too, and pick one here, once, from what the CPU has. ZG_CPU_ISA=avx2|portable
// caps the choice (to compare them, or to rule a path out).
#pragma once

namespace zg::cpu {

enum class Isa { portable, avx2, avx512 };  // avx2: with FMA; avx512: AVX-512F too

Isa cpu_isa();
const char* name(Isa isa);

}  // namespace zg::cpu
