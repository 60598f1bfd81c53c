// The fused AdamW update over flat spans: one pass reads grad, m, v and the
// master weights, writes m, v, master, and the compute copy (bf16/f16) of the new
// master -- the weights the model runs with -- rounded once.
#include <cmath>

#include "cuda/backend.h"
#include "cuda/kernels.cuh"

namespace zg::cuda {

namespace {

// The step's constants, computed once on the host in f64: a difference such as 1 - beta2
// (0.999) taken after rounding beta2 to f32 would be 1e-5 off, and 1 - lr * weight_decay
// would lose most of lr * weight_decay.
struct AdamWConstants {
  double eps, grad_scale;
  double beta1, beta2, one_minus_beta1, one_minus_beta2;
  double decay;           // lr * weight_decay
  double step_size;       // lr / (1 - beta1^step)
  double inv_sqrt_bias2;  // 1 / sqrt(1 - beta2^step)
};

// Per element, in the master's precision M (f32, or f64 for f64 training), as PyTorch's
// fused AdamW works in f32: an f64 division and square root cost tens of f64 operations
// each, enough to make an update over 100M parameters compute-bound on an H100. (The CPU
// backend works in f64; the two agree to f32 rounding.) See AdamWStep in tensor/backend.h:
//   g = grad * grad_scale;  p -= lr * weight_decay * p   (= p * (1 - lr * weight_decay))
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   p -= step_size * m / (sqrt(v) * inv_sqrt_bias2 + eps);  compute = round(p)
//   step_size = lr / bias1, inv_sqrt_bias2 = 1 / sqrt(bias2): the CPU kernel's form
// M: master/m/v (f32 or f64); G: grad; C: the compute copy (void: none).
// device_scale (may be null): one M on the device that multiplies grad_scale (f64 training
// clips by an f64 coefficient, as step() does on the host).
template <class M, class G, class C>
__global__ void adamw_kernel(M* master, const G* grad, M* m, M* v, C* compute, int64_t n, AdamWConstants s,
                             const M* device_scale) {
  using GC = acc_t<G>;  // the gradient is scaled in its own compute type, before rounding to M
  const GC grad_scale =
      static_cast<GC>(device_scale ? s.grad_scale * static_cast<double>(*device_scale) : s.grad_scale);
  const M decay = static_cast<M>(s.decay), step_size = static_cast<M>(s.step_size), eps = static_cast<M>(s.eps);
  const M beta1 = static_cast<M>(s.beta1), beta2 = static_cast<M>(s.beta2);
  const M one_minus_beta1 = static_cast<M>(s.one_minus_beta1), one_minus_beta2 = static_cast<M>(s.one_minus_beta2);
  const M inv_sqrt_bias2 = static_cast<M>(s.inv_sqrt_bias2);
  for (int64_t i = grid_index(); i < n; i += grid_stride()) {
    const M g = static_cast<M>(widen(grad[i]) * grad_scale);
    M p = master[i];
    p -= decay * p;
    const M mi = beta1 * m[i] + one_minus_beta1 * g;
    const M vi = beta2 * v[i] + one_minus_beta2 * g * g;
    p -= step_size * (mi / (math_sqrt(vi) * inv_sqrt_bias2 + eps));
    master[i] = p;
    m[i] = mi;
    v[i] = vi;
    if constexpr (!std::is_void_v<C>) compute[i] = convert<C>(p);  // as CPU copy(master, compute)
  }
}

}  // namespace

void CudaBackend::adamw(const Tensor& master, const Tensor& grad, const Tensor& m, const Tensor& v,
                        const Tensor& compute, const AdamWStep& step) {
  check_adamw_arguments(master, grad, m, v, compute, step);
  const int64_t n = master.numel();
  const bool has_compute = compute.defined() && !compute.is_same(master);
  const Tensor& scale = step.device_scale;
  const AdamWConstants s{.eps = step.eps,
                         .grad_scale = step.grad_scale,
                         .beta1 = step.beta1,
                         .beta2 = step.beta2,
                         .one_minus_beta1 = 1.0 - step.beta1,
                         .one_minus_beta2 = 1.0 - step.beta2,
                         .decay = step.lr * step.weight_decay,
                         .step_size = step.lr / (1.0 - std::pow(step.beta1, static_cast<double>(step.step))),
                         .inv_sqrt_bias2 = 1.0 / std::sqrt(1.0 - std::pow(step.beta2, static_cast<double>(step.step)))};
  OnDevice on(master.device());
  dispatch_device(master.dtype(), [&]<class M>() {
    if constexpr (!std::is_same_v<M, float> && !std::is_same_v<M, double>) {
      fail("adamw: master weights must be f32 or f64, got ", name(master.dtype()));
    } else {
      dispatch_device(grad.dtype(), [&]<class G>() {
        if constexpr (!is_float_v<G>) {
          fail("adamw: not defined for ", name(grad.dtype()));
        } else {
          auto launch = [&]<class C>(C* compute_ptr) {
            if (n == 0) return;
            adamw_kernel<M, G, C><<<blocks_for(n), kThreads, 0, on.stream>>>(
                device_ptr<M>(master), device_ptr<const G>(grad), device_ptr<M>(m), device_ptr<M>(v), compute_ptr, n, s,
                scale.defined() ? device_ptr<const M>(scale) : nullptr);
            ZG_CUDA_CHECK_LAUNCH();
          };
          if (!has_compute) return launch(static_cast<void*>(nullptr));
          dispatch_device(compute.dtype(), [&]<class C>() { launch(device_ptr<C>(compute)); });
        }
      });
    }
  });
}

}  // namespace zg::cuda
