// The fused AdamW update on the CPU (Backend::adamw): one pass over a span reads grad,
// master, m and v once and writes master, m, v and the compute copy once, with the
// operations, order and precision of cuda/adamw.cu (f32 math for f32 masters, f64 for f64):
//   g  = grad * grad_scale
//   p -= lr * wd * p
//   m  = beta1 m + (1 - beta1) g          v = beta2 v + (1 - beta2) g^2
//   p -= step_size * m / (sqrt(v) * inv_sqrt_bias2 + eps),
//        step_size = lr / (1 - beta1^t), inv_sqrt_bias2 = 1 / sqrt(1 - beta2^t)  (f64 on the host)
// (DeepSpeed's CPU Adam's form: one division and one square root an element.)
// It is what CPU training and ZeRO-Offload's host step run, so it is built for bandwidth:
// the f32-master cases with f32 or bf16 gradients and compute copies have an AVX-512 loop
// (16 lanes) and an AVX2 loop (8 lanes), the widest the CPU has picked at run time
// (tensor/cpu/isa.h), all giving the portable loop's bits: no FMA in any,
// and a span of more than one block is shared by the backend's worker threads
// (tensor/cpu/thread_pool.h).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>

#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics read an "undefined" vector it then warns about (its bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#endif

#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/isa.h"
#include "tensor/cpu/loops.h"
#include "tensor/cpu/thread_pool.h"

namespace zg::cpu {

namespace {

// The update's constants, in the master's precision M.
template <class M>
struct AdamWConstants {
  M step_size, decay, beta1, beta2, one_minus_beta1, one_minus_beta2, inv_sqrt_bias2, eps;
  double grad_scale;  // applied in the gradient's compute type, as the GPU does
};

// Elements [begin, end) of one span, one at a time. Not inlined into the vector loops'
// tails, where the target's FMAs would let the compiler contract its products and sums.
template <class M, class G, class C>
[[gnu::noinline]] void adamw_scalar(M* p, const G* g, M* m, M* v, C* out, const AdamWConstants<M>& s, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    using GC = compute_t<G>;
    const M gi = static_cast<M>(static_cast<GC>(g[i]) * static_cast<GC>(s.grad_scale));
    M pi = p[i];
    pi -= s.decay * pi;
    const M mi = s.beta1 * m[i] + s.one_minus_beta1 * gi;
    const M vi = s.beta2 * v[i] + s.one_minus_beta2 * gi * gi;
    pi -= s.step_size * (mi / (std::sqrt(vi) * s.inv_sqrt_bias2 + s.eps));
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if constexpr (!std::is_void_v<C>) out[i] = convert<C>(pi);
  }
}

#if defined(__x86_64__)
// AVX2: 8 f32 lanes. bf16 in: the 16 bits shifted up; bf16 out: BFloat16::from_float's
// round-to-nearest-even and quiet NaN, lane by lane.
[[gnu::target("avx2")]] inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
[[gnu::target("avx2")]] inline __m256 load8(const BFloat16* x) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
[[gnu::target("avx2")]] inline void store8(float* x, __m256 value) { _mm256_storeu_ps(x, value); }
[[gnu::target("avx2")]] inline void store8(BFloat16* x, __m256 value) {
  const __m256i u = _mm256_castps_si256(value);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i is_nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i bits = _mm256_blendv_epi8(rounded, quiet, is_nan);  // each < 2^16: packs without saturating
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm256_castsi256_si128(packed));
}

template <class G, class C>
[[gnu::target("avx2")]] void adamw_avx2(float* p, const G* g, float* m, float* v, C* out,
                                         const AdamWConstants<float>& s, int64_t begin, int64_t end) {
  const __m256 grad_scale = _mm256_set1_ps(static_cast<float>(s.grad_scale)), decay = _mm256_set1_ps(s.decay);
  const __m256 step_size = _mm256_set1_ps(s.step_size);
  const __m256 beta1 = _mm256_set1_ps(s.beta1), beta2 = _mm256_set1_ps(s.beta2);
  const __m256 one_minus_beta1 = _mm256_set1_ps(s.one_minus_beta1), one_minus_beta2 = _mm256_set1_ps(s.one_minus_beta2);
  const __m256 inv_sqrt_bias2 = _mm256_set1_ps(s.inv_sqrt_bias2), eps = _mm256_set1_ps(s.eps);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 gi = _mm256_mul_ps(load8(g + i), grad_scale);
    __m256 pi = _mm256_loadu_ps(p + i);
    pi = _mm256_sub_ps(pi, _mm256_mul_ps(decay, pi));
    const __m256 mi = _mm256_add_ps(_mm256_mul_ps(beta1, _mm256_loadu_ps(m + i)), _mm256_mul_ps(one_minus_beta1, gi));
    const __m256 vi = _mm256_add_ps(_mm256_mul_ps(beta2, _mm256_loadu_ps(v + i)),
                                    _mm256_mul_ps(_mm256_mul_ps(one_minus_beta2, gi), gi));
    const __m256 denominator = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), inv_sqrt_bias2), eps);
    pi = _mm256_sub_ps(pi, _mm256_mul_ps(step_size, _mm256_div_ps(mi, denominator)));
    _mm256_storeu_ps(p + i, pi);
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    if constexpr (!std::is_void_v<C>) store8(out + i, pi);
  }
  adamw_scalar(p, g, m, v, out, s, i, end);  // the last < 8
}

// AVX-512F: 16 f32 lanes, the same steps. Products and sums through the masked forms
// (all lanes): builtins, which GCC's -ffp-contract=fast cannot fuse into the FMAs
// AVX-512F has, as it may a plain vector a * b + c.
[[gnu::target("avx512f")]] inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
[[gnu::target("avx512f")]] inline __m512 load16(const BFloat16* x) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
[[gnu::target("avx512f")]] inline void store16(float* x, __m512 value) { _mm512_storeu_ps(x, value); }
[[gnu::target("avx512f")]] inline void store16(BFloat16* x, __m512 value) {
  const __m512i u = _mm512_castps_si512(value);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 is_nan =
      _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __m512i bits = _mm512_mask_blend_epi32(is_nan, rounded, quiet);  // each < 2^16: truncating keeps it
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), _mm512_cvtepi32_epi16(bits));
}

constexpr __mmask16 kAll = 0xffff;
[[gnu::target("avx512f")]] inline __m512 mul(__m512 a, __m512 b) { return _mm512_maskz_mul_ps(kAll, a, b); }
[[gnu::target("avx512f")]] inline __m512 add(__m512 a, __m512 b) { return _mm512_maskz_add_ps(kAll, a, b); }
[[gnu::target("avx512f")]] inline __m512 sub(__m512 a, __m512 b) { return _mm512_maskz_sub_ps(kAll, a, b); }

template <class G, class C>
[[gnu::target("avx512f")]] void adamw_avx512(float* p, const G* g, float* m, float* v, C* out,
                                              const AdamWConstants<float>& s, int64_t begin, int64_t end) {
  const __m512 grad_scale = _mm512_set1_ps(static_cast<float>(s.grad_scale)), decay = _mm512_set1_ps(s.decay);
  const __m512 step_size = _mm512_set1_ps(s.step_size);
  const __m512 beta1 = _mm512_set1_ps(s.beta1), beta2 = _mm512_set1_ps(s.beta2);
  const __m512 one_minus_beta1 = _mm512_set1_ps(s.one_minus_beta1), one_minus_beta2 = _mm512_set1_ps(s.one_minus_beta2);
  const __m512 inv_sqrt_bias2 = _mm512_set1_ps(s.inv_sqrt_bias2), eps = _mm512_set1_ps(s.eps);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 gi = mul(load16(g + i), grad_scale);
    __m512 pi = _mm512_loadu_ps(p + i);
    pi = sub(pi, mul(decay, pi));
    const __m512 mi = add(mul(beta1, _mm512_loadu_ps(m + i)), mul(one_minus_beta1, gi));
    const __m512 vi = add(mul(beta2, _mm512_loadu_ps(v + i)), mul(mul(one_minus_beta2, gi), gi));
    const __m512 denominator = add(mul(_mm512_maskz_sqrt_ps(kAll, vi), inv_sqrt_bias2), eps);
    pi = sub(pi, mul(step_size, _mm512_maskz_div_ps(kAll, mi, denominator)));
    _mm512_storeu_ps(p + i, pi);
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    if constexpr (!std::is_void_v<C>) store16(out + i, pi);
  }
  adamw_scalar(p, g, m, v, out, s, i, end);  // the last < 16
}

#endif

// The best loop this CPU has for these element types, over [begin, end).
template <class M, class G, class C>
void adamw_range(M* p, const G* g, M* m, M* v, C* out, const AdamWConstants<M>& s, int64_t begin, int64_t end) {
#if defined(__x86_64__)
  constexpr bool vectorized = std::is_same_v<M, float> && (std::is_same_v<G, float> || std::is_same_v<G, BFloat16>) &&
                              (std::is_void_v<C> || std::is_same_v<C, float> || std::is_same_v<C, BFloat16>);
  if constexpr (vectorized) {
    const Isa isa = cpu_isa();
    if (isa == Isa::avx512) return adamw_avx512(p, g, m, v, out, s, begin, end);
    if (isa == Isa::avx2) return adamw_avx2(p, g, m, v, out, s, begin, end);
  }
#endif
  adamw_scalar(p, g, m, v, out, s, begin, end);
}

// Blocks of 256Ki elements (7 MiB of f32 state and gradient): large enough that taking
// one costs nothing, small enough that two cores finish within a block of each other.
constexpr int64_t kBlock = int64_t{1} << 18;

}  // namespace

void CpuBackend::adamw(const Tensor& master, const Tensor& grad, const Tensor& m, const Tensor& v,
                       const Tensor& compute, const AdamWStep& step) {
  check_adamw_arguments(master, grad, m, v, compute, step);
  const Tensor& scale = step.device_scale;
  const double grad_scale = scale.defined() ? step.grad_scale * scale.to(DType::f64).item<double>() : step.grad_scale;
  const bool has_compute = compute.defined() && !compute.is_same(master);
  with_float(master.dtype(), "adamw", [&]<class M>() {
    if constexpr (std::is_same_v<M, float> || std::is_same_v<M, double>) {
      const double bias1 = 1.0 - std::pow(step.beta1, static_cast<double>(step.step));
      const double bias2 = 1.0 - std::pow(step.beta2, static_cast<double>(step.step));
      const AdamWConstants<M> s{static_cast<M>(step.lr / bias1),
                                static_cast<M>(step.lr * step.weight_decay),
                                static_cast<M>(step.beta1),
                                static_cast<M>(step.beta2),
                                static_cast<M>(1.0 - step.beta1),
                                static_cast<M>(1.0 - step.beta2),
                                static_cast<M>(1.0 / std::sqrt(bias2)),
                                static_cast<M>(step.eps),
                                grad_scale};
      with_float(grad.dtype(), "adamw", [&]<class G>() {
        const auto run = [&]<class C>(C* out) {
          parallel_for(master.numel(), kBlock, [&](int64_t begin, int64_t end) {
            adamw_range(master.data<M>(), grad.data<G>(), m.data<M>(), v.data<M>(), out, s, begin, end);
          });
        };
        if (!has_compute) return run(static_cast<void*>(nullptr));
        with_float(compute.dtype(), "adamw", [&]<class C>() { run(compute.data<C>()); });
      });
    } else {
      fail("adamw: master weights must be f32 or f64, got ", name(master.dtype()));
    }
  });
}

}  // namespace zg::cpu
