// Fused attention on the CPU, f32 (Backend::attention): blocks of query rows, each a few
// GEMMs through Eigen, so the [T, S] scores of a (batch, head) never exist whole -- only
// a block's [rows, keys] -- and with a causal mask a block stops at its last row's key,
// skipping the masked half of the products. (b, h) pairs are shared by the worker threads.
//   forward   S = q_blk k^T scale (masked: -inf),  lse_i = log sum_j exp(S_ij),
//             P = exp(S - lse),  out_blk = P v
//   backward  P again from lse,  dP = dout_blk v^T,  D_i = dout_i . out_i,
//             dS = P (dP - D) scale,  dq_blk = dS k,  dk += dS^T q_blk,  dv += P^T dout_blk
// f64 (and 16-bit) attention stays composed: the statistics it keeps are f32.
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>

#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/thread_pool.h"

namespace zg::cpu {

namespace {

constexpr int64_t kRows = 64;  // query rows a block

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using View = Eigen::Map<Matrix, 0, Eigen::OuterStride<>>;

// The [rows, D] matrix of (b, h) in a [B, H, rows, D] tensor with unit stride in D.
View matrix_of(const Tensor& t, int64_t b, int64_t h) {
  const auto& s = t.strides();
  return View(static_cast<float*>(t.data_ptr()) + b * s[0] + h * s[1], t.size(2), t.size(3),
              Eigen::OuterStride<>(s[2]));
}

bool fusable(std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors)
    if (t->dtype() != DType::f32 || t->dim() != 4 || t->strides()[3] != 1 || t->numel() == 0) return false;
  return true;
}

// Keys a query block [i0, i1) sees: all, or (causal) up to its last row.
int64_t keys_seen(int64_t i1, int64_t keys, bool causal) { return causal ? std::min(i1, keys) : keys; }

// S = q_blk k^T scale over the keys seen, masked -inf past each row's own key (causal).
void scores(const View& q, const View& k, int64_t i0, int64_t rows, int64_t seen, bool causal, float scale,
            Matrix& s) {
  s.noalias() = (q.middleRows(i0, rows) * k.topRows(seen).transpose()) * scale;
  if (causal)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = i0 + r + 1; j < seen; ++j) s(r, j) = -std::numeric_limits<float>::infinity();
}

}  // namespace

bool CpuBackend::attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                           const Tensor& out, const Tensor& stats) {
  if (!fusable({&q, &k, &v, &out})) return false;
  const int64_t batch = q.size(0), heads = q.size(1), queries = q.size(2), keys = k.size(2);
  parallel_for(batch * heads, 1, [&](int64_t begin, int64_t end) {
    Matrix s;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      const View qm = matrix_of(q, b, h), km = matrix_of(k, b, h), vm = matrix_of(v, b, h);
      View om = matrix_of(out, b, h);
      float* lse = stats.data<float>() + bh * queries;
      for (int64_t i0 = 0; i0 < queries; i0 += kRows) {
        const int64_t rows = std::min(kRows, queries - i0), seen = keys_seen(i0 + rows, keys, causal);
        scores(qm, km, i0, rows, seen, causal, static_cast<float>(scale), s);
        for (int64_t r = 0; r < rows; ++r) {
          auto row = s.row(r);
          const float max = row.maxCoeff();
          row = (row.array() - max).exp();
          const float total = row.sum();
          row /= total;
          lse[i0 + r] = max + std::log(total);
        }
        om.middleRows(i0, rows).noalias() = s * vm.topRows(seen);
      }
    }
  });
  return true;
}

void CpuBackend::attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                    const Tensor& stats, const Tensor& grad_out, bool causal, double scale,
                                    const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  const int64_t batch = q.size(0), heads = q.size(1), queries = q.size(2), keys = k.size(2);
  const float factor = static_cast<float>(scale);
  parallel_for(batch * heads, 1, [&](int64_t begin, int64_t end) {
    Matrix p, dp;
    Eigen::VectorXf delta;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      const View qm = matrix_of(q, b, h), km = matrix_of(k, b, h), vm = matrix_of(v, b, h);
      const View om = matrix_of(out, b, h), gm = matrix_of(grad_out, b, h);
      View dqm = matrix_of(dq, b, h), dkm = matrix_of(dk, b, h), dvm = matrix_of(dv, b, h);
      dkm.setZero();
      dvm.setZero();
      const float* lse = stats.data<float>() + bh * queries;
      for (int64_t i0 = 0; i0 < queries; i0 += kRows) {
        const int64_t rows = std::min(kRows, queries - i0), seen = keys_seen(i0 + rows, keys, causal);
        scores(qm, km, i0, rows, seen, causal, factor, p);
        for (int64_t r = 0; r < rows; ++r) p.row(r) = (p.row(r).array() - lse[i0 + r]).exp();
        const auto g = gm.middleRows(i0, rows);
        dvm.topRows(seen).noalias() += p.transpose() * g;
        dp.noalias() = g * vm.topRows(seen).transpose();
        delta = (g.array() * om.middleRows(i0, rows).array()).rowwise().sum();
        p = (p.array() * (dp.array().colwise() - delta.array())) * factor;  // dS
        dqm.middleRows(i0, rows).noalias() = p * km.topRows(seen);
        dkm.topRows(seen).noalias() += p.transpose() * qm.middleRows(i0, rows);
      }
    }
  });
}

}  // namespace zg::cpu
