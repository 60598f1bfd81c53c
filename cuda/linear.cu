// Linear layers through cuBLASLt, whose epilogues finish each output tile while it is
// still on chip -- one pass over memory per layer instead of two or three:
//   forward    pre = x W^T + b,  out = gelu(pre)    epilogue BIAS, or GELU_AUX_BIAS
//                                                   (pre comes out as the aux matrix)
//   backward   dW = g^T x,  db = sum_rows(g)        epilogue BGRADB
// (the input gradient dx = g W is a plain GEMM: the front-end's matmul).
//
// As in gemm.cu, a row-major matrix read column-major is its transpose, so each
// row-major product is issued as its transpose:
//   out^T [N, M] = op_T(W^T stored [K, N]) * x^T [K, M]     bias: one per row of D (N)
//   dW^T  [K, N] = x^T [K, M] * op_T(g^T stored [N, M])      BGRADB: sums B = g over the
//                                                            GEMM's k = M, one per column of D (N)
// Where cuBLASLt has nothing for a case -- f64, an aux leading dimension that is not a
// multiple of 8, a bias, its gradient or the aux matrix not 16-byte aligned, no
// algorithm from the heuristic -- the
// composed default of Backend runs instead, with the same results up to rounding.
#include <cublasLt.h>

#include <cstdint>

#include "cuda/backend.h"
#include "cuda/check.h"
#include "cuda/gemm.h"
#include "cuda/kernels.cuh"
#include "cuda/rank_state.h"

namespace zg::cuda {

namespace {

// The descriptors of one cuBLASLt call, destroyed however the call ends.
struct LtCall {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  LtCall() = default;
  LtCall(const LtCall&) = delete;
  LtCall& operator=(const LtCall&) = delete;
  ~LtCall() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    for (cublasLtMatrixLayout_t layout : {d, b, a})
      if (layout) cublasLtMatrixLayoutDestroy(layout);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

template <class V>
void set(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attribute, const V& value) {
  ZG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, attribute, &value, sizeof(value)));
}

// The largest power of two (up to 256) dividing an address: what cuBLASLt may assume of it.
uint32_t alignment_of(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

struct LtGemm {
  cudaDataType_t type;
  cublasOperation_t trans_a, trans_b;
  int64_t m, n, k;  // D [m, n] = op(A) [m, k] op(B) [k, n], column-major
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  void* d;
  int64_t ldd;
  cublasLtEpilogue_t epilogue;
  const void* bias = nullptr;  // the bias (BIAS epilogues) or where its gradient goes (BGRAD)
  void* aux = nullptr;         // GELU_AUX: where the GELU input goes
  int64_t aux_ld = 0;
};

// Issues the GEMM on the rank's stream of `device`; false (nothing issued) where cuBLASLt
// has no algorithm for it.
bool run(Device device, const LtGemm& g) {
  OnDevice on(device);
  LtCall call;
  ZG_CUBLAS_CHECK(cublasLtMatmulDescCreate(&call.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set(call.op, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(g.trans_a));
  set(call.op, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(g.trans_b));
  set(call.op, CUBLASLT_MATMUL_DESC_EPILOGUE, g.epilogue);
  if (g.bias) set(call.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (g.aux) {
    set(call.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
    set(call.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.aux_ld);
  }
  // Layouts describe the matrices as stored: op(A) [m, k] is stored [m, k] or, transposed, [k, m].
  const bool a_n = g.trans_a == CUBLAS_OP_N, b_n = g.trans_b == CUBLAS_OP_N;
  ZG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.a, g.type, a_n ? g.m : g.k, a_n ? g.k : g.m, g.lda));
  ZG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.b, g.type, b_n ? g.k : g.n, b_n ? g.n : g.k, g.ldb));
  ZG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.d, g.type, g.m, g.n, g.ldd));
  ZG_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&call.preference));
  const uint64_t workspace_bytes = kGemmWorkspaceBytes;
  ZG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(call.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                       &workspace_bytes, sizeof(workspace_bytes)));
  // Split-K partial sums are reduced in the compute type (f32), never rounded to a 16-bit
  // output first -- the rule the cuBLAS path keeps with DISALLOW_REDUCED_PRECISION_REDUCTION.
  const uint32_t reduction_schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  ZG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(call.preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                       &reduction_schemes, sizeof(reduction_schemes)));
  // cuBLASLt assumes 256-byte aligned operands unless told otherwise; views may start anywhere.
  const std::pair<cublasLtMatmulPreferenceAttributes_t, const void*> alignments[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, g.a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, g.b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, g.d},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, g.d}};
  for (const auto& [attribute, pointer] : alignments) {
    const uint32_t alignment = alignment_of(pointer);
    ZG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(call.preference, attribute, &alignment, sizeof(alignment)));
  }
  const cublasLtHandle_t handle = rank_state(on.device).cublas_lt();
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, call.op, call.a, call.b, call.d, call.d,
                                                               call.preference, 1, &heuristic, &found);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && found == 0)) return false;
  ZG_CUBLAS_CHECK(status);
  const Tensor workspace = gemm_workspace(on.device);  // back to the stream-ordered allocator on return
  const float alpha = 1, beta = 0;
  ZG_CUBLAS_CHECK(cublasLtMatmul(handle, call.op, &alpha, g.a, call.a, g.b, call.b, &beta, g.d, call.d, g.d, call.d,
                                 &heuristic.algo, workspace.data_ptr(), static_cast<size_t>(kGemmWorkspaceBytes),
                                 on.stream));
  return true;
}

// The element types cuBLASLt's epilogues serve here (f64 takes the composed path).
template <class T>
constexpr bool lt_type_v = std::is_same_v<T, float> || is_half_v<T>;

}  // namespace

void CudaBackend::linear(const Tensor& x, const Tensor& weight, const Tensor& bias, Activation act, const Tensor& out,
                         const Tensor& pre) {
  const int64_t rows = x.size(0), in = x.size(1), features = weight.size(0);
  const bool gelu = act == Activation::gelu;
  bool fused = false;
  dispatch_device(x.dtype(), [&]<class T>() {
    if constexpr (lt_type_v<T>) {
      if (rows == 0 || features == 0 || in == 0 || (!gelu && !bias.defined())) return;  // plain GEMM: cuBLAS
      if (gelu && (features % 8 != 0 || alignment_of(pre.data_ptr()) < 16)) return;
      if (bias.defined() && alignment_of(bias.data_ptr()) < 16) return;
      const cublasLtEpilogue_t epilogue = !gelu                ? CUBLASLT_EPILOGUE_BIAS
                                          : bias.defined() ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                                           : CUBLASLT_EPILOGUE_GELU_AUX;
      fused = run(out.device(), {gemm_types<T>().data, CUBLAS_OP_T, CUBLAS_OP_N, features, rows, in, weight.data_ptr(),
                                 in, x.data_ptr(), in, out.data_ptr(), features, epilogue,
                                 bias.defined() ? bias.data_ptr() : nullptr, gelu ? pre.data_ptr() : nullptr,
                                 gelu ? features : 0});
    }
  });
  if (!fused) Backend::linear(x, weight, bias, act, out, pre);
}

void CudaBackend::linear_weight_grad(const Tensor& grad, const Tensor& x, const Tensor& grad_weight,
                                     const Tensor& grad_bias) {
  const int64_t rows = x.size(0), in = x.size(1), features = grad.size(1);
  bool fused = false;
  dispatch_device(x.dtype(), [&]<class T>() {
    if constexpr (lt_type_v<T>) {
      if (rows == 0 || features == 0 || in == 0 || !grad_bias.defined()) return;  // plain GEMM: cuBLAS
      if (alignment_of(grad_bias.data_ptr()) < 16) return;  // a view into a flat gradient buffer may start anywhere
      fused = run(grad.device(), {gemm_types<T>().data, CUBLAS_OP_N, CUBLAS_OP_T, in, features, rows, x.data_ptr(),
                                  in, grad.data_ptr(), features, grad_weight.data_ptr(), in, CUBLASLT_EPILOGUE_BGRADB,
                                  grad_bias.data_ptr()});
    }
  });
  if (!fused) Backend::linear_weight_grad(grad, x, grad_weight, grad_bias);
}

}  // namespace zg::cuda
