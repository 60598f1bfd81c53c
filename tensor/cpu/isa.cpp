#include "tensor/cpu/isa.h"

#include <cstdlib>
#include <string_view>

#include "tensor/error.h"

namespace zg::cpu {

namespace {

Isa detect() {
  const char* cap = std::getenv("ZG_CPU_ISA");
  const std::string_view limit = cap == nullptr ? "avx512" : cap;
  ZG_CHECK(limit == "avx512" || limit == "avx2" || limit == "portable",
           "ZG_CPU_ISA must be avx512, avx2 or portable (the widest vector unit the CPU kernels may use), got '",
           limit, "'");
#if defined(__x86_64__)
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (limit == "avx512" && avx2 && __builtin_cpu_supports("avx512f")) return Isa::avx512;
  if (limit != "portable" && avx2) return Isa::avx2;
#endif
  return Isa::portable;
}

}  // namespace

Isa cpu_isa() {
  static const Isa isa = detect();
  return isa;
}

const char* name(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    case Isa::portable: break;
  }
  return "portable";
}

}  // namespace zg::cpu
