// Row kernels of the neural-network primitives: softmax, layer norm, embedding
// and cross-entropy. Statistics are accumulated in f64; the exponentials of softmax and
// cross-entropy run through Eigen's vectorised f64 exp (within an ulp of std::exp; the
// build for this CPU's ISA, vectorized.h), a row at a time in a scratch buffer of the
// thread's. Blocks of rows run on the worker threads (loops.h: for_each_row).
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/loops.h"
#include "tensor/cpu/thread_pool.h"
#include "tensor/cpu/vectorized.h"

namespace zg::cpu {

namespace {

// A row's log(sum(exp(row))) as two parts, lse = max + log_total with log_total =
// log(sum(exp(row - max))). Callers form x - lse as (x - max) - log_total: added up first,
// max + log_total loses log_total where |max| is large (1e20 + 0.69 is 1e20). A NaN or
// +inf in the row makes the total NaN, and so the whole row's result (as in PyTorch).
struct RowLse {
  double max, log_total;
  double shifted(double x) const { return (x - max) - log_total; }  // x - lse
};

using Row = Eigen::Map<Eigen::ArrayXd>;

// A row in f64, in this thread's scratch buffer (valid until the next call on the thread).
template <class T>
Row widened_row(const T* row, int64_t length) {
  thread_local std::vector<double> scratch;
  if (static_cast<int64_t>(scratch.size()) < length) scratch.resize(static_cast<size_t>(length));
  for (int64_t j = 0; j < length; ++j) scratch[static_cast<size_t>(j)] = static_cast<double>(compute_t<T>(row[j]));
  return Row(scratch.data(), length);
}

RowLse row_lse(const Row& row) {
  double max = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < row.size(); ++j) max = std::max(max, row[j]);  // NaN passes over, as it must
  return {max, std::log(vector_kernels().sum_exp(row.data(), row.size(), max))};
}

template <class T>
RowLse row_lse(const T* row, int64_t length) { return row_lse(widened_row(row, length)); }

// An optional f32 operand (a layer norm's weight, bias or their gradients): null when absent.
float* f32_or_null(const Tensor& t) { return t.defined() ? t.data<float>() : nullptr; }

}  // namespace

// softmax(x)_j = exp(x_j - lse(x)),  log_softmax(x)_j = x_j - lse(x)  (RowLse::shifted).
void CpuBackend::softmax(const Tensor& in, bool log, const Tensor& out) {
  const int64_t rows = in.size(0), length = in.size(1);
  with_float(in.dtype(), "softmax", [&]<class T>() {
    for_each_row(rows, length, [&](int64_t i) {
      T* y = out.data<T>() + i * length;
      Row row = widened_row(in.data<T>() + i * length, length);
      const RowLse lse = row_lse(row);
      if (log) row = (row - lse.max) - lse.log_total;  // x - lse, as RowLse::shifted
      else vector_kernels().exp_shifted(row.data(), length, lse.max, lse.log_total);
      for (int64_t j = 0; j < length; ++j) y[j] = convert<T>(row[j]);
    });
  });
}

// mean = sum(x) / C,  var = sum((x - mean)^2) / C,  rstd = 1 / sqrt(var + eps),
// out = (x - mean) * rstd * weight + bias.
void CpuBackend::layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, const Tensor& out,
                            const Tensor& mean, const Tensor& rstd) {
  const int64_t rows = x.size(0), channels = x.size(1);
  if (x.dtype() == DType::f32 && mean.dtype() == DType::f32 && channels % 4 == 0)
    return vector_kernels().layer_norm_f32(x.data<float>(), f32_or_null(weight), f32_or_null(bias), rows, channels, eps,
                                           out.data<float>(), mean.data<float>(), rstd.data<float>());
  with_float(x.dtype(), "layer_norm", [&]<class T>() {
    const T* w = weight.defined() ? weight.data<T>() : nullptr;
    const T* b = bias.defined() ? bias.data<T>() : nullptr;
    for_each_row(rows, channels, [&](int64_t i) {
      const T* row = x.data<T>() + i * channels;
      T* y = out.data<T>() + i * channels;
      double total = 0, squares = 0;
      for (int64_t j = 0; j < channels; ++j) total += static_cast<double>(compute_t<T>(row[j]));
      const double mu = total / static_cast<double>(channels);
      for (int64_t j = 0; j < channels; ++j) {
        const double d = static_cast<double>(compute_t<T>(row[j])) - mu;
        squares += d * d;
      }
      const double r = 1.0 / std::sqrt(squares / static_cast<double>(channels) + eps);
      for (int64_t j = 0; j < channels; ++j) {
        double v = (static_cast<double>(compute_t<T>(row[j])) - mu) * r;
        if (w) v *= static_cast<double>(compute_t<T>(w[j]));
        if (b) v += static_cast<double>(compute_t<T>(b[j]));
        y[j] = convert<T>(v);
      }
      dispatch(mean.dtype(), [&]<class S>() {
        mean.data<S>()[i] = convert<S>(mu);
        rstd.data<S>()[i] = convert<S>(r);
      });
    });
  });
}

// xhat = (x - mean) rstd, gxhat = g w:
//   dx = rstd (gxhat - mean_C(gxhat) - xhat mean_C(gxhat xhat)),  dw = sum_M(g xhat),  db = sum_M(g).
void CpuBackend::layer_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                     const Tensor& rstd, const Tensor& grad_x, const Tensor& grad_weight,
                                     const Tensor& grad_bias) {
  const int64_t rows = x.size(0), channels = x.size(1);
  const auto width = static_cast<double>(channels);
  if (x.dtype() == DType::f32 && mean.dtype() == DType::f32 && channels % 4 == 0)
    return vector_kernels().layer_norm_backward_f32(grad_out.data<float>(), x.data<float>(), f32_or_null(weight),
                                                    mean.data<float>(), rstd.data<float>(), rows, channels,
                                                    grad_x.data<float>(), f32_or_null(grad_weight),
                                                    f32_or_null(grad_bias));
  with_float(x.dtype(), "layer_norm_backward", [&]<class T>() {
    const T* w = weight.defined() ? weight.data<T>() : nullptr;
    auto at = [](const T* p, int64_t j) { return static_cast<double>(compute_t<T>(p[j])); };
    const auto statistics = [&](int64_t i, double& mu, double& r) {
      dispatch(mean.dtype(), [&]<class S>() {
        mu = static_cast<double>(compute_t<S>(mean.data<S>()[i]));
        r = static_cast<double>(compute_t<S>(rstd.data<S>()[i]));
      });
    };
    // dx: blocks of rows on the worker threads.
    for_each_row(rows, channels, [&](int64_t i) {
      const T* xr = x.data<T>() + i * channels;
      const T* g = grad_out.data<T>() + i * channels;
      double mu = 0, r = 0;
      statistics(i, mu, r);
      double mean_gxhat = 0, mean_gxhat_xhat = 0;
      for (int64_t j = 0; j < channels; ++j) {
        const double xhat = (at(xr, j) - mu) * r, gxhat = at(g, j) * (w ? at(w, j) : 1.0);
        mean_gxhat += gxhat;
        mean_gxhat_xhat += gxhat * xhat;
      }
      mean_gxhat /= width;
      mean_gxhat_xhat /= width;
      T* dx = grad_x.data<T>() + i * channels;
      for (int64_t j = 0; j < channels; ++j) {
        const double xhat = (at(xr, j) - mu) * r, gxhat = at(g, j) * (w ? at(w, j) : 1.0);
        dx[j] = convert<T>(r * (gxhat - mean_gxhat - xhat * mean_gxhat_xhat));
      }
    });
    // dw, db: blocks of channels on the worker threads, each channel summed over the rows in
    // order (the same sums at any thread count).
    if (!grad_weight.defined() && !grad_bias.defined()) return;
    parallel_for(channels, row_grain(rows), [&](int64_t c0, int64_t c1) {  // blocks of about kElementGrain elements
      std::vector<double> dw(static_cast<size_t>(c1 - c0)), db(static_cast<size_t>(c1 - c0));
      for (int64_t i = 0; i < rows; ++i) {
        const T* xr = x.data<T>() + i * channels;
        const T* g = grad_out.data<T>() + i * channels;
        double mu = 0, r = 0;
        statistics(i, mu, r);
        for (int64_t j = c0; j < c1; ++j) {
          dw[j - c0] += at(g, j) * ((at(xr, j) - mu) * r);
          db[j - c0] += at(g, j);
        }
      }
      for (int64_t j = c0; j < c1; ++j) {
        if (grad_weight.defined()) grad_weight.data<T>()[j] = convert<T>(dw[j - c0]);
        if (grad_bias.defined()) grad_bias.data<T>()[j] = convert<T>(db[j - c0]);
      }
    });
  });
}

void CpuBackend::embedding(const Tensor& weight, const Tensor& indices, const Tensor& out) {
  const int64_t vocab = weight.size(0), row_bytes = weight.size(1) * weight.element_size();
  const char* w = static_cast<const char*>(weight.data_ptr());
  char* y = static_cast<char*>(out.data_ptr());
  dispatch(indices.dtype(), [&]<class I>() {
    if constexpr (std::is_integral_v<I> && !std::is_same_v<I, bool>) {
      const I* idx = indices.data<I>();
      for (int64_t i = 0; i < indices.numel(); ++i) {
        const int64_t row = idx[i];
        ZG_CHECK(row >= 0 && row < vocab, "embedding: index ", row, " is out of range for a weight of ", vocab,
                 " rows (", describe(weight), ")");
        std::memcpy(y + i * row_bytes, w + row * row_bytes, static_cast<size_t>(row_bytes));
      }
    }
  });
}

// grad_weight[v, :] += sum over the i with indices[i] = v of grad_out[i, :], each
// row's sum taken in f64 in order of i and added once: the positions are stably
// sorted by index, so each row's contributions form one segment. The CUDA backend
// does the same (a radix sort, then a thread per segment and channel): the two agree
// bit for bit, and a repeated token loses no precision to bf16 rounding on each add.
void CpuBackend::embedding_backward(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_weight) {
  const int64_t channels = grad_weight.size(1), n = indices.numel();
  with_float(grad_weight.dtype(), "embedding_backward", [&]<class T>() {
    dispatch(indices.dtype(), [&]<class I>() {
      if constexpr (std::is_integral_v<I> && !std::is_same_v<I, bool>) {
        const I* idx = indices.data<I>();
        std::vector<int64_t> order(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) order[i] = i;
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return idx[a] < idx[b]; });
        std::vector<double> total(static_cast<size_t>(channels));
        for (int64_t start = 0; start < n;) {
          const int64_t row = idx[order[start]];
          int64_t end = start;
          std::fill(total.begin(), total.end(), 0.0);
          for (; end < n && idx[order[end]] == row; ++end) {
            const T* g = grad_out.data<T>() + order[end] * channels;
            for (int64_t c = 0; c < channels; ++c) total[c] += static_cast<double>(compute_t<T>(g[c]));
          }
          ZG_CHECK(row >= 0 && row < grad_weight.size(0), "embedding_backward: index ", row,
                   " is out of range for a weight of ", grad_weight.size(0), " rows");
          T* w = grad_weight.data<T>() + row * channels;
          for (int64_t c = 0; c < channels; ++c) w[c] = convert<T>(static_cast<double>(compute_t<T>(w[c])) + total[c]);
          start = end;
        }
      }
    });
  });
}

// loss_i = lse(logits_i) - logits_i[target_i], or 0 where target_i == ignore_index.
void CpuBackend::cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                               const Tensor& loss) {
  const int64_t rows = logits.size(0), classes = logits.size(1);
  with_float(logits.dtype(), "cross_entropy", [&]<class T>() {
    dispatch(target.dtype(), [&]<class I>() {
      if constexpr (std::is_integral_v<I> && !std::is_same_v<I, bool>) {
        for_each_row(rows, classes, [&](int64_t i) {
          const int64_t t = target.data<I>()[i];
          using Loss = std::conditional_t<std::is_same_v<T, double>, double, float>;
          if (t == ignore_index) {
            loss.data<Loss>()[i] = 0;
            return;
          }
          ZG_CHECK(t >= 0 && t < classes, "cross_entropy: target ", t, " is out of range for ", classes,
                   " classes (row ", i, ")");
          const T* row = logits.data<T>() + i * classes;
          loss.data<Loss>()[i] =
              static_cast<Loss>(-row_lse(row, classes).shifted(static_cast<double>(compute_t<T>(row[t]))));
        });
      }
    });
  });
}

// The softmax from the loss, which holds lse_i - x_i[t_i]: x_ij - lse_i = (x_ij - x_i[t_i])
// - loss_i, without adding up a large lse. The row's stats again where the loss cannot
// serve (Backend::kCrossEntropyLossUsable): not finite (x[t] = -inf), or so large that its
// f32 rounding error would sit in the exponent of every probability:
//   dx_i = g_i (exp(x_i - lse_i) - onehot(t_i)), 0 for ignored rows.
void CpuBackend::cross_entropy_backward(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                                        const Tensor& loss, const Tensor& grad_loss, const Tensor& grad_logits) {
  const int64_t rows = logits.size(0), classes = logits.size(1);
  with_float(logits.dtype(), "cross_entropy_backward", [&]<class T>() {
    dispatch(target.dtype(), [&]<class I>() {
      if constexpr (std::is_integral_v<I> && !std::is_same_v<I, bool>) {
        using Loss = std::conditional_t<std::is_same_v<T, double>, double, float>;
        for_each_row(rows, classes, [&](int64_t i) {
          const int64_t t = target.data<I>()[i];
          const T* x = logits.data<T>() + i * classes;
          T* dx = grad_logits.data<T>() + i * classes;
          if (t == ignore_index) {
            std::fill(dx, dx + classes, convert<T>(0.0));
            return;
          }
          // Checked again: the forward checked these targets, but their bytes may have
          // been written since through a raw pointer, which no version counter sees.
          ZG_CHECK(t >= 0 && t < classes, "cross_entropy_backward: target ", t, " is out of range for ", classes,
                   " classes (row ", i, ")");
          const double g = grad_loss.data<Loss>()[i];
          const double target_logit = static_cast<double>(compute_t<T>(x[t]));
          const double loss_i = static_cast<double>(loss.data<Loss>()[i]);
          // x - lse as (x - x[t]) - loss, or from the row's stats: x - lse = (x - max) - log_total.
          const bool usable = std::isfinite(target_logit) && std::fabs(loss_i) <= kCrossEntropyLossUsable;
          const RowLse lse = usable ? RowLse{target_logit, loss_i} : row_lse(x, classes);
          Row p = widened_row(x, classes);
          vector_kernels().exp_shifted(p.data(), classes, lse.max, lse.log_total);  // the probabilities, exp(x - lse)
          for (int64_t j = 0; j < classes; ++j) dx[j] = convert<T>(g * (p[j] - (j == t ? 1.0 : 0.0)));
        });
      }
    });
  });
}

}  // namespace zg::cpu

