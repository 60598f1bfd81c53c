// One table of ops, run on every device and dtype and compared with naive f64
// references written from the definitions (in the spirit of ggml's
// test-backend-ops). Inputs include broadcast and transposed (non-contiguous) views.
#include <algorithm>
#include <numeric>

#include "helpers.h"
#include "tensor/cpu/isa.h"
#include "tensor/cpu/vectorized.h"

namespace zg::test {
namespace {

// ---- naive references ----

Host map1(const Host& x, const std::function<double(double)>& f) {
  Host out{x.shape, x.data};
  for (double& v : out.data) v = f(v);
  return out;
}

Host map2(const Host& a, const Host& b, const std::function<double(double, double)>& f) {
  const Shape shape = broadcast_shapes(a.shape, b.shape, "reference");
  Host out{shape, std::vector<double>(numel(shape))};
  for (int64_t i = 0; i < out.numel(); ++i) {
    const Shape idx = unravel(i, shape);
    out.data[i] = f(a.data[broadcast_position(idx, a.shape)], b.data[broadcast_position(idx, b.shape)]);
  }
  return out;
}

Host where_ref(const Host& c, const Host& a, const Host& b) {
  const Shape shape = broadcast_shapes(broadcast_shapes(c.shape, a.shape, "ref"), b.shape, "ref");
  Host out{shape, std::vector<double>(numel(shape))};
  for (int64_t i = 0; i < out.numel(); ++i) {
    const Shape idx = unravel(i, shape);
    out.data[i] = c.data[broadcast_position(idx, c.shape)] != 0 ? a.data[broadcast_position(idx, a.shape)]
                                                                 : b.data[broadcast_position(idx, b.shape)];
  }
  return out;
}

// Groups the elements of x by their position outside `dims` and applies f to each group.
Host reduce_ref(const Host& x, Shape dims, bool keepdim, const std::function<double(const std::vector<double>&)>& f) {
  const int64_t rank = static_cast<int64_t>(x.shape.size());
  std::vector<bool> reduced(rank, dims.empty());
  for (int64_t d : dims) reduced[d < 0 ? d + rank : d] = true;
  Shape kept, out_shape;
  for (int64_t d = 0; d < rank; ++d) {
    if (!reduced[d]) kept.push_back(x.shape[d]);
    if (keepdim || !reduced[d]) out_shape.push_back(reduced[d] ? 1 : x.shape[d]);
  }
  std::vector<std::vector<double>> groups(numel(kept));
  for (int64_t i = 0; i < x.numel(); ++i) {
    const Shape idx = unravel(i, x.shape);
    int64_t pos = 0;
    for (int64_t d = 0; d < rank; ++d)
      if (!reduced[d]) pos = pos * x.shape[d] + idx[d];
    groups[pos].push_back(x.data[i]);
  }
  Host out{out_shape, {}};
  for (const auto& g : groups) out.data.push_back(f(g));
  return out;
}

double sum_of(const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0); }
double mean_of(const std::vector<double>& v) { return sum_of(v) / static_cast<double>(v.size()); }
double max_of(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }
double min_of(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
double argmax_of(const std::vector<double>& v) { return static_cast<double>(std::max_element(v.begin(), v.end()) - v.begin()); }
double argmin_of(const std::vector<double>& v) { return static_cast<double>(std::min_element(v.begin(), v.end()) - v.begin()); }

Host transpose_last(const Host& x) {
  Shape shape = x.shape;
  const size_t r = shape.size();
  std::swap(shape[r - 1], shape[r - 2]);
  Host out{shape, std::vector<double>(x.data.size())};
  for (int64_t i = 0; i < out.numel(); ++i) {
    Shape idx = unravel(i, shape);
    std::swap(idx[r - 1], idx[r - 2]);
    out.data[i] = x.data[broadcast_position(idx, x.shape)];
  }
  return out;
}

// torch.matmul semantics, by the definition C[..., i, j] = sum_k A[..., i, k] B[..., k, j].
Host matmul_ref(Host a, Host b, bool ta, bool tb) {
  const bool a_vec = a.shape.size() == 1, b_vec = b.shape.size() == 1;
  if (a_vec) a.shape.insert(a.shape.begin(), 1);
  if (b_vec) b.shape.push_back(1);
  if (ta) a = transpose_last(a);
  if (tb) b = transpose_last(b);
  const int64_t m = a.shape[a.shape.size() - 2], k = a.shape.back(), n = b.shape.back();
  const Shape a_batch(a.shape.begin(), a.shape.end() - 2), b_batch(b.shape.begin(), b.shape.end() - 2);
  Shape shape = broadcast_shapes(a_batch, b_batch, "ref");
  const Shape batch = shape;
  shape.push_back(m);
  shape.push_back(n);
  Host out{shape, std::vector<double>(numel(shape))};
  for (int64_t i = 0; i < out.numel(); ++i) {
    Shape idx = unravel(i, shape);
    const int64_t row = idx[idx.size() - 2], col = idx.back();
    Shape bidx(idx.begin(), idx.end() - 2);
    double acc = 0;
    for (int64_t kk = 0; kk < k; ++kk) {
      Shape ai = bidx, bi = bidx;
      ai.push_back(row), ai.push_back(kk), bi.push_back(kk), bi.push_back(col);
      Shape a_full = a_batch, b_full = b_batch;
      a_full.push_back(m), a_full.push_back(k), b_full.push_back(k), b_full.push_back(n);
      acc += a.data[broadcast_position(ai, a_full)] * b.data[broadcast_position(bi, b_full)];
    }
    out.data[i] = acc;
  }
  if (b_vec) out.shape.erase(out.shape.end() - 1);
  if (a_vec) out.shape.erase(out.shape.end() - (b_vec ? 1 : 2));
  return out;
}

// Applies f to every 1-D line of x along `dim` (in place on a copy).
Host along_dim(const Host& x, int64_t dim, const std::function<void(std::vector<double>&)>& f) {
  const int64_t rank = static_cast<int64_t>(x.shape.size());
  dim = dim < 0 ? dim + rank : dim;
  Host out = x;
  const int64_t size = x.shape[dim];
  int64_t stride = 1;
  for (int64_t d = dim + 1; d < rank; ++d) stride *= x.shape[d];
  for (int64_t i = 0; i < x.numel(); ++i) {
    if (unravel(i, x.shape)[dim] != 0) continue;
    std::vector<double> line(size);
    for (int64_t j = 0; j < size; ++j) line[j] = x.data[i + j * stride];
    f(line);
    for (int64_t j = 0; j < size; ++j) out.data[i + j * stride] = line[j];
  }
  return out;
}

Host softmax_ref(const Host& x, int64_t dim, bool log) {
  return along_dim(x, dim, [log](std::vector<double>& v) {
    const double m = max_of(v);
    double s = 0;
    for (double e : v) s += std::exp(e - m);
    for (double& e : v) e = log ? e - m - std::log(s) : std::exp(e - m) / s;
  });
}

double gelu_ref(double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); }

// y = x W^T + b (then GELU): x [..., K], W [N, K], b [N].
Host linear_ref(const Host& x, const Host& w, const Host& b, bool gelu) {
  Host y = matmul_ref(x, w, false, true);
  for (int64_t i = 0; i < y.numel(); ++i) {
    const double pre = y.data[i] + b.data[i % y.shape.back()];
    y.data[i] = gelu ? gelu_ref(pre) : pre;
  }
  return y;
}

Host layer_norm_ref(const Host& x, const Host* w, const Host* b, double eps) {
  return along_dim(x, -1, [&](std::vector<double>& v) {
    const double mu = mean_of(v);
    double var = 0;
    for (double e : v) var += (e - mu) * (e - mu);
    var /= static_cast<double>(v.size());
    for (size_t j = 0; j < v.size(); ++j)
      v[j] = (v[j] - mu) / std::sqrt(var + eps) * (w ? w->data[j] : 1.0) + (b ? b->data[j] : 0.0);
  });
}

// y[..., i, j] = f(i, j, x[..., i, j]) over the last two dims.
Host map_matrix(const Host& x, const std::function<double(int64_t, int64_t, double)>& f) {
  Host out = x;
  const int64_t rows = x.shape[x.shape.size() - 2], cols = x.shape.back();
  for (int64_t i = 0; i < x.numel(); ++i) out.data[i] = f(i / cols % rows, i % cols, x.data[i]);
  return out;
}

// Multi-head attention by its definition, k and v heads shared by groups of q heads:
// q [B, H, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv].
Host attention_ref(const Host& q, const Host& k, const Host& v, bool causal) {
  const int64_t batch = q.shape[0], heads = q.shape[1], t_len = q.shape[2], d = q.shape[3];
  const int64_t kv_heads = k.shape[1], s_len = k.shape[2], dv = v.shape[3];
  Host out{{batch, heads, t_len, dv}, std::vector<double>(static_cast<size_t>(batch * heads * t_len * dv))};
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t kh = h / (heads / kv_heads);
      for (int64_t i = 0; i < t_len; ++i) {
        std::vector<double> w(static_cast<size_t>(s_len), -INFINITY);
        for (int64_t j = 0; j < s_len && (!causal || j <= i); ++j) {
          double dot = 0;
          for (int64_t c = 0; c < d; ++c)
            dot += q.data[((b * heads + h) * t_len + i) * d + c] * k.data[((b * kv_heads + kh) * s_len + j) * d + c];
          w[j] = dot / std::sqrt(static_cast<double>(d));
        }
        const double m = *std::max_element(w.begin(), w.end());
        double total = 0;
        for (double& e : w) total += (e = std::exp(e - m));
        for (int64_t c = 0; c < dv; ++c) {
          double acc = 0;
          for (int64_t j = 0; j < s_len; ++j) acc += w[j] / total * v.data[((b * kv_heads + kh) * s_len + j) * dv + c];
          out.data[((b * heads + h) * t_len + i) * dv + c] = acc;
        }
      }
    }
  return out;
}

Host scalar(double v) { return Host{{}, {v}}; }

void partial_sums(std::vector<double>& v) { std::partial_sum(v.begin(), v.end(), v.begin()); }

// out[i] = x[source(i)] over a row-major `shape`; an empty source index gives `fill`.
Host remap(const Host& x, const Shape& shape, const std::function<Shape(Shape)>& source, double fill = 0) {
  Host out{shape, std::vector<double>(numel(shape))};
  for (int64_t i = 0; i < out.numel(); ++i) {
    const Shape from = source(unravel(i, shape));
    out.data[i] = from.empty() ? fill : x.data[broadcast_position(from, x.shape)];
  }
  return out;
}

// The vector p-norm of a group, by its definition.
std::function<double(const std::vector<double>&)> p_norm(double p) {
  return [p](const std::vector<double>& v) {
    double total = 0;
    for (double e : v) total = std::isinf(p) ? std::max(total, std::fabs(e)) : total + std::pow(std::fabs(e), p);
    return std::isinf(p) ? total : std::pow(total, 1 / p);
  };
}

// ---- the table ----

enum class Kind { normal, positive, small_int, boolean, index };
struct Input {
  Shape shape;
  Kind kind = Kind::normal;
  bool transposed = false;  // made as the transpose of a contiguous tensor: a strided view
  int64_t bound = 0;        // indices in [0, bound)
};

using Run = std::function<Tensor(const std::vector<Tensor>&)>;
using Ref = std::function<Host(const std::vector<Host>&)>;
struct OpCase {
  std::string name;
  std::vector<Input> inputs;
  Run run;
  Ref reference;
};

Tensor make_input(const Input& in, DType dtype, Device device) {
  Shape shape = in.shape;
  if (in.transposed) std::swap(shape[shape.size() - 1], shape[shape.size() - 2]);
  Tensor t;
  switch (in.kind) {
    case Kind::normal: t = randn(shape, TensorOptions(dtype).device(device)); break;
    case Kind::positive: t = uniform(shape, 0.5, 2.0, TensorOptions(dtype).device(device)); break;
    case Kind::small_int: t = mul(rand(shape, TensorOptions(dtype).device(device)), 3.0).to(DType::i64).to(dtype); break;
    case Kind::boolean: t = lt(rand(shape, TensorOptions(DType::f32).device(device)), 0.5); break;
    case Kind::index: t = mul(rand(shape, TensorOptions(DType::f64).device(device)), in.bound).to(DType::i64); break;
  }
  return in.transposed ? t.transpose(-1, -2) : t;
}

#define T1 [](const std::vector<Tensor>& x)
#define H1 [](const std::vector<Host>& x)

std::vector<OpCase> op_table() {
  const Input mat{{3, 4}, Kind::normal, true};
  const Input pos{{3, 4}, Kind::positive, true};
  std::vector<OpCase> cases = {
      {"neg", {mat}, T1 { return neg(x[0]); }, H1 { return map1(x[0], [](double v) { return -v; }); }},
      {"abs", {mat}, T1 { return abs(x[0]); }, H1 { return map1(x[0], [](double v) { return std::fabs(v); }); }},
      {"exp", {mat}, T1 { return exp(x[0]); }, H1 { return map1(x[0], [](double v) { return std::exp(v); }); }},
      {"log", {pos}, T1 { return log(x[0]); }, H1 { return map1(x[0], [](double v) { return std::log(v); }); }},
      {"sqrt", {pos}, T1 { return sqrt(x[0]); }, H1 { return map1(x[0], [](double v) { return std::sqrt(v); }); }},
      {"rsqrt", {pos}, T1 { return rsqrt(x[0]); }, H1 { return map1(x[0], [](double v) { return 1 / std::sqrt(v); }); }},
      {"sin", {mat}, T1 { return sin(x[0]); }, H1 { return map1(x[0], [](double v) { return std::sin(v); }); }},
      {"cos", {mat}, T1 { return cos(x[0]); }, H1 { return map1(x[0], [](double v) { return std::cos(v); }); }},
      {"tanh", {mat}, T1 { return tanh(x[0]); }, H1 { return map1(x[0], [](double v) { return std::tanh(v); }); }},
      {"sigmoid", {mat}, T1 { return sigmoid(x[0]); }, H1 { return map1(x[0], [](double v) { return 1 / (1 + std::exp(-v)); }); }},
      {"relu", {mat}, T1 { return relu(x[0]); }, H1 { return map1(x[0], [](double v) { return !(v <= 0) ? v : 0.0; }); }},
      {"gelu", {mat}, T1 { return gelu(x[0]); }, H1 { return map1(x[0], gelu_ref); }},
      {"add broadcast", {{{2, 3, 4}}, {{3, 1}}}, T1 { return add(x[0], x[1]); },
       H1 { return map2(x[0], x[1], std::plus<>()); }},
      {"sub outer", {{{4, 1}}, {{1, 5}}}, T1 { return x[0] - x[1]; }, H1 { return map2(x[0], x[1], std::minus<>()); }},
      {"mul strided", {mat, {{3, 4}}}, T1 { return x[0] * x[1]; }, H1 { return map2(x[0], x[1], std::multiplies<>()); }},
      {"div", {{{2, 3}}, {{3}, Kind::positive}}, T1 { return x[0] / x[1]; },
       H1 { return map2(x[0], x[1], std::divides<>()); }},
      {"pow", {{{2, 3}, Kind::positive}, {{2, 3}}}, T1 { return pow(x[0], x[1]); },
       H1 { return map2(x[0], x[1], [](double a, double b) { return std::pow(a, b); }); }},
      {"maximum", {mat, {{4}}}, T1 { return maximum(x[0], x[1]); },
       H1 { return map2(x[0], x[1], [](double a, double b) { return std::max(a, b); }); }},
      {"minimum", {mat, {{1}}}, T1 { return minimum(x[0], x[1]); },
       H1 { return map2(x[0], x[1], [](double a, double b) { return std::min(a, b); }); }},
      {"add scalar", {mat}, T1 { return x[0] + 1.5; }, H1 { return map1(x[0], [](double v) { return v + 1.5; }); }},
      {"scalar minus", {mat}, T1 { return 2.0 - x[0]; }, H1 { return map1(x[0], [](double v) { return 2.0 - v; }); }},
      {"scalar over", {pos}, T1 { return 1.0 / x[0]; }, H1 { return map1(x[0], [](double v) { return 1.0 / v; }); }},
      {"pow scalar", {pos}, T1 { return pow(x[0], 3.0); }, H1 { return map1(x[0], [](double v) { return v * v * v; }); }},
      {"eq", {{{3, 4}, Kind::small_int}, {{4}, Kind::small_int}}, T1 { return eq(x[0], x[1]); },
       H1 { return map2(x[0], x[1], [](double a, double b) { return double(a == b); }); }},
      {"ne", {{{3, 4}, Kind::small_int}, {{3, 1}, Kind::small_int}}, T1 { return ne(x[0], x[1]); },
       H1 { return map2(x[0], x[1], [](double a, double b) { return double(a != b); }); }},
      {"lt", {mat, {{4}}}, T1 { return lt(x[0], x[1]); }, H1 { return map2(x[0], x[1], [](double a, double b) { return double(a < b); }); }},
      {"le", {{{3, 4}, Kind::small_int}, {{4}, Kind::small_int}}, T1 { return le(x[0], x[1]); },
       H1 { return map2(x[0], x[1], [](double a, double b) { return double(a <= b); }); }},
      {"gt scalar", {mat}, T1 { return gt(x[0], 0.25); }, H1 { return map1(x[0], [](double v) { return double(v > 0.25); }); }},
      {"ge", {{{3, 4}, Kind::small_int}, {{3, 4}, Kind::small_int, true}}, T1 { return ge(x[0], x[1]); },
       H1 { return map2(x[0], x[1], [](double a, double b) { return double(a >= b); }); }},
      {"where", {{{3, 4}, Kind::boolean}, {{3, 4}}, {{4}}}, T1 { return where(x[0], x[1], x[2]); },
       H1 { return where_ref(x[0], x[1], x[2]); }},
      {"masked_fill", {mat, {{4}, Kind::boolean}}, T1 { return masked_fill(x[0], x[1], -7.0); },
       H1 { return map2(x[0], x[1], [](double v, double m) { return m != 0 ? -7.0 : v; }); }},
      {"sum all", {{{2, 3, 4}}}, T1 { return sum(x[0]); }, H1 { return reduce_ref(x[0], {}, false, sum_of); }},
      {"sum dims keepdim", {{{2, 3, 4}}}, T1 { return sum(x[0], {0, 2}, true); },
       H1 { return reduce_ref(x[0], {0, 2}, true, sum_of); }},
      {"sum strided", {mat}, T1 { return sum(x[0], {1}); }, H1 { return reduce_ref(x[0], {1}, false, sum_of); }},
      {"mean last", {{{2, 3, 4}}}, T1 { return mean(x[0], {-1}); }, H1 { return reduce_ref(x[0], {-1}, false, mean_of); }},
      {"mean all", {mat}, T1 { return mean(x[0]); }, H1 { return reduce_ref(x[0], {}, false, mean_of); }},
      {"max dim", {{{2, 3, 4}}}, T1 { return max(x[0], {1}); }, H1 { return reduce_ref(x[0], {1}, false, max_of); }},
      {"min keepdim", {mat}, T1 { return min(x[0], {0}, true); }, H1 { return reduce_ref(x[0], {0}, true, min_of); }},
      {"argmax", {{{2, 3, 4}}}, T1 { return argmax(x[0], 1); }, H1 { return reduce_ref(x[0], {1}, false, argmax_of); }},
      {"argmin keepdim", {mat}, T1 { return argmin(x[0], -1, true); },
       H1 { return reduce_ref(x[0], {-1}, true, argmin_of); }},
      {"argmax flat", {mat}, T1 { return argmax(x[0]); }, H1 { return reduce_ref(x[0], {}, false, argmax_of); }},
      {"matmul", {{{3, 4}}, {{4, 5}}}, T1 { return matmul(x[0], x[1]); },
       H1 { return matmul_ref(x[0], x[1], false, false); }},
      // K past one 256-deep block and tiles cut by C's edges: the bias starts the first block only.
      {"linear bias", {{{2, 7, 300}}, {{37, 300}}, {{37}}}, T1 { return linear(x[0], x[1], x[2]); },
       H1 { return linear_ref(x[0], x[1], x[2], false); }},
      {"linear bias gelu", {{{3, 20}}, {{17, 20}}, {{17}}}, T1 { return linear(x[0], x[1], x[2], Activation::gelu); },
       H1 { return linear_ref(x[0], x[1], x[2], true); }},
      {"matmul strided", {{{3, 4}, Kind::normal, true}, {{4, 5}, Kind::normal, true}}, T1 { return matmul(x[0], x[1]); },
       H1 { return matmul_ref(x[0], x[1], false, false); }},
      {"matmul batch broadcast", {{{2, 1, 3, 4}}, {{3, 4, 2}}}, T1 { return matmul(x[0], x[1]); },
       H1 { return matmul_ref(x[0], x[1], false, false); }},
      {"matmul trans_a", {{{2, 4, 3}}, {{4, 5}}}, T1 { return matmul(x[0], x[1], true, false); },
       H1 { return matmul_ref(x[0], x[1], true, false); }},
      {"matmul trans_b", {{{2, 3, 4}}, {{2, 5, 4}}}, T1 { return matmul(x[0], x[1], false, true); },
       H1 { return matmul_ref(x[0], x[1], false, true); }},
      {"matmul vector-matrix", {{{4}}, {{2, 4, 5}}}, T1 { return matmul(x[0], x[1]); },
       H1 { return matmul_ref(x[0], x[1], false, false); }},
      {"matmul matrix-vector", {{{3, 4}}, {{4}}}, T1 { return matmul(x[0], x[1]); },
       H1 { return matmul_ref(x[0], x[1], false, false); }},
      {"matmul dot", {{{4}}, {{4}}}, T1 { return matmul(x[0], x[1]); }, H1 { return matmul_ref(x[0], x[1], false, false); }},
      {"softmax last", {{{3, 4, 5}}}, T1 { return softmax(x[0]); }, H1 { return softmax_ref(x[0], -1, false); }},
      {"softmax dim0", {{{3, 4, 5}}}, T1 { return softmax(x[0], 0); }, H1 { return softmax_ref(x[0], 0, false); }},
      {"log_softmax", {mat}, T1 { return log_softmax(x[0], 1); }, H1 { return softmax_ref(x[0], 1, true); }},
      {"layer_norm", {{{2, 3, 8}}, {{8}}, {{8}}}, T1 { return layer_norm(x[0], x[1], x[2], 1e-5); },
       H1 { return layer_norm_ref(x[0], &x[1], &x[2], 1e-5); }},
      {"layer_norm C=6", {{{5, 6}}, {{6}}, {{6}}}, T1 { return layer_norm(x[0], x[1], x[2], 1e-5); },
       H1 { return layer_norm_ref(x[0], &x[1], &x[2], 1e-5); }},  // f32 rows not in fours: the scalar kernel
      {"layer_norm plain", {mat}, T1 { return layer_norm(x[0], Tensor(), Tensor(), 1e-5); },
       H1 { return layer_norm_ref(x[0], nullptr, nullptr, 1e-5); }},
      {"add_layer_norm", {{{2, 3, 8}}, {{2, 3, 8}}, {{8}}, {{8}}},
       T1 {
         const AddLayerNormOutput r = add_layer_norm(x[0], x[1], x[2], x[3], 1e-5);
         return cat({r.sum, r.out}, -1);
       },
       H1 {
         const Host sum = map2(x[0], x[1], std::plus<>()), out = layer_norm_ref(sum, &x[2], &x[3], 1e-5);
         Host both{{2, 3, 16}, {}};
         for (size_t row = 0; row < 6; ++row)
           for (const Host* h : {&sum, &out}) {
             const auto first = h->data.begin() + static_cast<std::ptrdiff_t>(row * 8);
             both.data.insert(both.data.end(), first, first + 8);
           }
         return both;
       }},
      {"embedding", {{{6, 4}}, {{2, 3}, Kind::index, false, 6}}, T1 { return embedding(x[0], x[1]); },
       H1 {
         Shape shape = x[1].shape;
         shape.push_back(4);
         Host out{shape, {}};
         for (double i : x[1].data)
           for (int64_t c = 0; c < 4; ++c) out.data.push_back(x[0].data[static_cast<int64_t>(i) * 4 + c]);
         return out;
       }},
      {"cross_entropy", {{{2, 3, 7}}, {{2, 3}, Kind::index, false, 7}}, T1 { return cross_entropy(x[0], x[1]); },
       H1 {
         const Host logp = softmax_ref(x[0], -1, true);
         double total = 0;
         for (int64_t i = 0; i < 6; ++i) total -= logp.data[i * 7 + static_cast<int64_t>(x[1].data[i])];
         return Host{{}, {total / 6}};
       }},
      {"cat dim1", {{{2, 3}}, {{2, 2}, Kind::normal, true}}, T1 { return cat({x[0], x[1]}, 1); },
       H1 {
         Host out{{2, 5}, {}};
         for (int64_t r = 0; r < 2; ++r) {
           for (int64_t c = 0; c < 3; ++c) out.data.push_back(x[0].data[r * 3 + c]);
           for (int64_t c = 0; c < 2; ++c) out.data.push_back(x[1].data[r * 2 + c]);
         }
         return out;
       }},
      {"cast roundtrip", {mat}, T1 { return x[0].to(DType::f64).to(x[0].dtype()); }, H1 { return x[0]; }},
      {"stack dim1", {{{2, 3}}, {{2, 3}, Kind::normal, true}}, T1 { return stack({x[0], x[1]}, 1); },
       H1 {
         Host out{{2, 2, 3}, {}};
         for (int64_t r = 0; r < 2; ++r)
           for (const Host* h : {&x[0], &x[1]}) out.data.insert(out.data.end(), h->data.begin() + r * 3, h->data.begin() + r * 3 + 3);
         return out;
       }},
      {"index_select dim1", {{{2, 5, 3}}, {{4}, Kind::index, false, 5}}, T1 { return index_select(x[0], 1, x[1]); },
       H1 {
         Host out{{2, 4, 3}, {}};
         for (int64_t b = 0; b < 2; ++b)
           for (double i : x[1].data)
             for (int64_t c = 0; c < 3; ++c) out.data.push_back(x[0].data[(b * 5 + static_cast<int64_t>(i)) * 3 + c]);
         return out;
       }},
      {"gather dim1", {{{3, 5, 2}}, {{2, 4, 2}, Kind::index, false, 5}}, T1 { return gather(x[0], 1, x[1]); },
       H1 {
         Host out{{2, 4, 2}, {}};
         for (int64_t a = 0; a < 2; ++a)
           for (int64_t j = 0; j < 4; ++j)
             for (int64_t c = 0; c < 2; ++c)
               out.data.push_back(x[0].data[(a * 5 + static_cast<int64_t>(x[1].data[(a * 4 + j) * 2 + c])) * 2 + c]);
         return out;
       }},
      {"scatter_add dim0", {{{4, 3}}, {{5, 2}, Kind::index, false, 4}, {{5, 2}}},
       T1 { return scatter_add(x[0], 0, x[1], x[2]); },
       H1 {
         Host out = x[0];
         for (int64_t j = 0; j < 5; ++j)
           for (int64_t c = 0; c < 2; ++c) out.data[static_cast<int64_t>(x[1].data[j * 2 + c]) * 3 + c] += x[2].data[j * 2 + c];
         return out;
       }},
      {"one_hot", {{{2, 3}, Kind::index, false, 4}}, T1 { return one_hot(x[0], 4); },
       H1 {
         Host out{{2, 3, 4}, {}};
         for (double i : x[0].data)
           for (int64_t c = 0; c < 4; ++c) out.data.push_back(static_cast<double>(c == static_cast<int64_t>(i)));
         return out;
       }},
      {"sort descending dim0", {{{4, 3}}}, T1 { return sort(x[0], 0, true).values; },
       H1 { return along_dim(x[0], 0, [](std::vector<double>& v) { std::stable_sort(v.begin(), v.end(), std::greater<>()); }); }},
      {"sort indices", {mat}, T1 { return sort(x[0]).indices; },
       H1 {
         return along_dim(x[0], -1, [](std::vector<double>& v) {
           std::vector<double> order(v.size());
           std::iota(order.begin(), order.end(), 0.0);
           std::stable_sort(order.begin(), order.end(), [&](double a, double b) { return v[size_t(a)] < v[size_t(b)]; });
           v = order;
         });
       }},
      {"topk", {{{2, 3, 5}}}, T1 { return topk(x[0], 2).values; },
       H1 {
         Host sorted = along_dim(x[0], -1, [](std::vector<double>& v) { std::stable_sort(v.begin(), v.end(), std::greater<>()); });
         Host out{{2, 3, 2}, {}};
         for (int64_t r = 0; r < 6; ++r) out.data.insert(out.data.end(), sorted.data.begin() + r * 5, sorted.data.begin() + r * 5 + 2);
         return out;
       }},
      {"erf", {mat}, T1 { return erf(x[0]); }, H1 { return map1(x[0], [](double v) { return std::erf(v); }); }},
      {"gelu_exact", {mat}, T1 { return gelu_exact(x[0]); },
       H1 { return map1(x[0], [](double v) { return 0.5 * v * (1 + std::erf(v / std::sqrt(2.0))); }); }},
      {"silu", {mat}, T1 { return silu(x[0]); }, H1 { return map1(x[0], [](double v) { return v / (1 + std::exp(-v)); }); }},
      {"clamp", {mat}, T1 { return clamp(x[0], -0.5, 0.75); },
       H1 { return map1(x[0], [](double v) { return std::min(std::max(v, -0.5), 0.75); }); }},
      {"logsumexp dims", {{{2, 3, 4}}}, T1 { return logsumexp(x[0], {0, 2}); },
       H1 {
         return reduce_ref(x[0], {0, 2}, false, [](const std::vector<double>& v) {
           const double m = max_of(v);
           double s = 0;
           for (double e : v) s += std::exp(e - m);
           return m + std::log(s);
         });
       }},
      {"var keepdim", {{{2, 3, 4}}}, T1 { return var(x[0], {-1}, true); },
       H1 {
         return reduce_ref(x[0], {-1}, true, [](const std::vector<double>& v) {
           const double mu = mean_of(v);
           double s = 0;
           for (double e : v) s += (e - mu) * (e - mu);
           return s / static_cast<double>(v.size() - 1);
         });
       }},
      {"std all biased", {mat}, T1 { return std(x[0], {}, false, 0); },
       H1 {
         return reduce_ref(x[0], {}, false, [](const std::vector<double>& v) {
           const double mu = mean_of(v);
           double s = 0;
           for (double e : v) s += (e - mu) * (e - mu);
           return std::sqrt(s / static_cast<double>(v.size()));
         });
       }},
      {"tril", {{{2, 3, 4}}}, T1 { return tril(x[0]); },
       H1 { return map_matrix(x[0], [](int64_t i, int64_t j, double v) { return j - i <= 0 ? v : 0.0; }); }},
      {"triu diagonal 1", {mat}, T1 { return triu(x[0], 1); },
       H1 { return map_matrix(x[0], [](int64_t i, int64_t j, double v) { return j - i >= 1 ? v : 0.0; }); }},
      {"rms_norm", {{{2, 3, 8}}, {{8}}}, T1 { return rms_norm(x[0], x[1], 1e-6); },
       H1 {
         Host out = x[0];
         for (int64_t r = 0; r < 6; ++r) {
           double squares = 0;
           for (int64_t c = 0; c < 8; ++c) squares += x[0].data[r * 8 + c] * x[0].data[r * 8 + c];
           for (int64_t c = 0; c < 8; ++c)
             out.data[r * 8 + c] = x[0].data[r * 8 + c] / std::sqrt(squares / 8 + 1e-6) * x[1].data[c];
         }
         return out;
       }},
      {"rotary_embedding", {{{2, 5, 4}}}, T1 { return rotary_embedding(x[0], 3, 100.0); },
       H1 {
         Host out = x[0];
         for (int64_t r = 0; r < 10; ++r)
           for (int64_t i = 0; i < 2; ++i) {
             const double angle = static_cast<double>(3 + r % 5) * std::pow(100.0, -2.0 * static_cast<double>(i) / 4);
             const double a = x[0].data[r * 4 + i], b = x[0].data[r * 4 + 2 + i];
             out.data[r * 4 + i] = a * std::cos(angle) - b * std::sin(angle);
             out.data[r * 4 + 2 + i] = b * std::cos(angle) + a * std::sin(angle);
           }
         return out;
       }},
      {"attention grouped-query", {{{1, 4, 3, 2}}, {{1, 2, 3, 2}}, {{1, 2, 3, 2}}},
       T1 { return scaled_dot_product_attention(x[0], x[1], x[2], true); },
       H1 { return attention_ref(x[0], x[1], x[2], true); }},
      {"mse_loss", {mat, {{3, 4}}}, T1 { return mse_loss(x[0], x[1]); },
       H1 {
         double total = 0;
         for (int64_t i = 0; i < 12; ++i) total += (x[0].data[i] - x[1].data[i]) * (x[0].data[i] - x[1].data[i]);
         return scalar(total / 12);
       }},
      {"nll_loss sum", {{{2, 3, 5}}, {{2, 3}, Kind::index, false, 5}}, T1 { return nll_loss(x[0], x[1], -100, Reduction::sum); },
       H1 {
         double total = 0;
         for (int64_t i = 0; i < 6; ++i) total -= x[0].data[i * 5 + static_cast<int64_t>(x[1].data[i])];
         return scalar(total);
       }},
      {"binary_cross_entropy", {{{3, 4}, Kind::positive}, {{3, 4}, Kind::boolean}},
       T1 { return binary_cross_entropy(x[0] / 2.5, x[1].to(x[0].dtype())); },
       H1 {
         double total = 0;
         for (int64_t i = 0; i < 12; ++i) {
           const double p = x[0].data[i] / 2.5, t = x[1].data[i];
           total -= t * std::log(p) + (1 - t) * std::log(1 - p);
         }
         return scalar(total / 12);
       }},
      {"binary_cross_entropy_with_logits none", {mat, {{3, 4}, Kind::positive}},
       T1 { return binary_cross_entropy_with_logits(x[0], x[1] / 2.0, Reduction::none); },
       H1 {
         return map2(x[0], x[1], [](double z, double t) {
           const double p = 1 / (1 + std::exp(-z));
           return -(t / 2.0 * std::log(p) + (1 - t / 2.0) * std::log(1 - p));
         });
       }},
      {"contiguous", {mat}, T1 { return x[0].contiguous(); }, H1 { return x[0]; }},
      // ---- issue 43's ops ----
      {"log1p", {pos}, T1 { return log1p(x[0] - 0.45); }, H1 { return map1(x[0], [](double v) { return std::log1p(v - 0.45); }); }},
      {"softplus beta threshold", {mat}, T1 { return softplus(x[0], 2.0, 1.5); },
       H1 { return map1(x[0], [](double v) { return 2 * v > 1.5 ? v : std::log1p(std::exp(2 * v)) / 2; }); }},
      {"leaky_relu", {mat}, T1 { return leaky_relu(x[0], 0.2); }, H1 { return map1(x[0], [](double v) { return v > 0 ? v : 0.2 * v; }); }},
      {"cumsum dim1", {{{2, 3, 4}}}, T1 { return cumsum(x[0], 1); }, H1 { return along_dim(x[0], 1, partial_sums); }},
      {"cumsum strided last", {mat}, T1 { return cumsum(x[0], -1); }, H1 { return along_dim(x[0], -1, partial_sums); }},
      {"flip dims 0 2", {{{2, 3, 4}}}, T1 { return flip(x[0], {0, 2}); },
       H1 { return remap(x[0], {2, 3, 4}, [](Shape i) { return Shape{1 - i[0], i[1], 3 - i[2]}; }); }},
      {"repeat", {{{2, 3}, Kind::normal, true}}, T1 { return repeat(x[0], {2, 1, 3}); },
       H1 { return remap(x[0], {2, 2, 9}, [](Shape i) { return Shape{i[1], i[2] % 3}; }); }},
      {"chunk", {{{2, 7}}}, T1 { return chunk(x[0], 3, 1)[1]; },
       H1 { return remap(x[0], {2, 3}, [](Shape i) { return Shape{i[0], i[1] + 3}; }); }},
      {"unbind", {{{2, 3, 4}}}, T1 { return unbind(x[0], 1)[2]; },
       H1 { return remap(x[0], {2, 4}, [](Shape i) { return Shape{i[0], 2, i[1]}; }); }},
      {"pad constant crop", {{{2, 3, 4}}}, T1 { return pad(x[0], {1, 2, -1, 1}, PadMode::constant, 0.5); },
       H1 {
         return remap(x[0], {2, 3, 7}, [](Shape i) { return i[1] < 2 && i[2] >= 1 && i[2] < 5 ? Shape{i[0], i[1] + 1, i[2] - 1} : Shape{}; }, 0.5);
       }},
      {"pad reflect", {mat}, T1 { return pad(x[0], {2, 1}, PadMode::reflect); },
       H1 {
         return remap(x[0], {3, 7}, [](Shape i) {
           const int64_t j = i[1] - 2;
           return Shape{i[0], j < 0 ? -j : j > 3 ? 6 - j : j};
         });
       }},
      {"pad replicate", {{{2, 3}}}, T1 { return pad(x[0], {1, 1, 2, 0}, PadMode::replicate); },
       H1 { return remap(x[0], {4, 5}, [](Shape i) { return Shape{std::max<int64_t>(i[0] - 2, 0), std::clamp<int64_t>(i[1] - 1, 0, 2)}; }); }},
      {"norm 2 dims", {{{2, 3, 4}}}, T1 { return norm(x[0], 2, {1, 2}); }, H1 { return reduce_ref(x[0], {1, 2}, false, p_norm(2)); }},
      {"norm 1 keepdim", {mat}, T1 { return norm(x[0], 1, {-1}, true); }, H1 { return reduce_ref(x[0], {-1}, true, p_norm(1)); }},
      {"norm 3", {{{2, 3, 4}}}, T1 { return norm(x[0], 3, {0}); }, H1 { return reduce_ref(x[0], {0}, false, p_norm(3)); }},
      {"norm inf", {mat}, T1 { return norm(x[0], INFINITY); }, H1 { return reduce_ref(x[0], {}, false, p_norm(INFINITY)); }},
      {"normalize", {mat}, T1 { return normalize(x[0], 2, 0); },
       H1 {
         const Host n = reduce_ref(x[0], {0}, true, p_norm(2));
         return map2(x[0], n, [](double v, double d) { return v / std::max(d, 1e-12); });
       }},
      {"isnan", {mat}, T1 { return isnan(log(x[0])); }, H1 { return map1(x[0], [](double v) { return double(v < 0); }); }},
      {"isinf", {mat}, T1 { return isinf(masked_fill(x[0], gt(x[0], 0.5), -INFINITY)); },
       H1 { return map1(x[0], [](double v) { return double(v > 0.5); }); }},
      {"any dims", {{{2, 3, 4}, Kind::small_int}}, T1 { return any(x[0], {1}); },
       H1 {
         return reduce_ref(x[0], {1}, false, [](const std::vector<double>& v) {
           return double(std::any_of(v.begin(), v.end(), [](double e) { return e != 0; }));
         });
       }},
      {"all keepdim", {{{2, 3, 4}, Kind::small_int}}, T1 { return all(x[0], {0, 2}, true); },
       H1 {
         return reduce_ref(x[0], {0, 2}, true, [](const std::vector<double>& v) {
           return double(std::all_of(v.begin(), v.end(), [](double e) { return e != 0; }));
         });
       }},
      {"einsum matmul", {{{3, 4}}, {{4, 5}, Kind::normal, true}}, T1 { return einsum("ij,jk->ik", {x[0], x[1]}); },
       H1 { return matmul_ref(x[0], x[1], false, false); }},
      {"einsum batched transposed", {{{2, 3, 4}}, {{2, 5, 4}}}, T1 { return einsum("bij,bkj->bik", {x[0], x[1]}); },
       H1 { return matmul_ref(x[0], x[1], false, true); }},
      {"einsum implicit matrix-vector", {{{3, 4}}, {{4}}}, T1 { return einsum("ij,j", {x[0], x[1]}); },
       H1 { return matmul_ref(x[0], x[1], false, false); }},
      {"einsum chain of three", {{{2, 3}}, {{3, 4}}, {{4, 2}}}, T1 { return einsum("ij,jk,kl->il", {x[0], x[1], x[2]}); },
       H1 { return matmul_ref(matmul_ref(x[0], x[1], false, false), x[2], false, false); }},
      {"einsum outer", {{{3}}, {{4}}}, T1 { return einsum("i,j->ij", {x[0], x[1]}); },
       H1 { return map2(Host{{3, 1}, x[0].data}, Host{{1, 4}, x[1].data}, std::multiplies<>()); }},
      {"einsum transpose", {mat}, T1 { return einsum("ij->ji", {x[0]}); }, H1 { return transpose_last(x[0]); }},
      {"einsum sum out", {{{2, 3, 4}}}, T1 { return einsum("bij->j", {x[0]}); }, H1 { return reduce_ref(x[0], {0, 1}, false, sum_of); }},
      {"linspace", {mat}, T1 { return linspace(-1.0, 2.0, 7, TensorOptions(x[0].dtype()).device(x[0].device())); },
       [](const std::vector<Host>&) { return Host{{7}, {-1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0}}; }},
      {"eye", {mat}, T1 { return eye(2, 3, TensorOptions(x[0].dtype()).device(x[0].device())); },
       [](const std::vector<Host>&) { return Host{{2, 3}, {1, 0, 0, 0, 1, 0}}; }},
  };
  return cases;
}

struct Tolerance {
  DType dtype;
  double rtol, atol;
};

}  // namespace

TEST_CASE("every op matches its naive reference on every device and dtype") {
  const Tolerance tolerances[] = {{DType::f64, 1e-12, 1e-12}, {DType::f32, 2e-5, 2e-5},
                                  {DType::bf16, 2e-2, 2e-2}, {DType::f16, 5e-3, 5e-3}};
  for (Device device : devices()) {
    for (const Tolerance& tol : tolerances) {
      manual_seed(1234);
      for (const OpCase& op : op_table()) {
        std::vector<Tensor> inputs;
        std::vector<Host> hosts;
        for (const Input& in : op.inputs) {
          inputs.push_back(make_input(in, tol.dtype, device));
          hosts.push_back(Host::of(inputs.back()));
        }
        const Tensor out = op.run(inputs);
        CHECK(out.device() == device);
        // Reductions to an index or a truth value are exact in any dtype.
        check_close(out, op.reference(hosts), tol.rtol, tol.atol,
                    op.name + " on " + device.str() + " in " + name(tol.dtype));
      }
    }
  }
}

TEST_CASE("ops on every device agree with the CPU, forward and backward, in every dtype") {
  // With a GPU present, every op of the table runs on both from the same inputs (the GPU
  // keeps the strided views, the CPU gets contiguous copies) and the results are compared
  // directly; so are the gradients of sum(out * w) with respect to every floating input.
  const auto devs = devices();
  if (devs.size() < 2) return;
  const Tolerance forward[] = {{DType::f64, 1e-12, 1e-12}, {DType::f32, 1e-5, 1e-5},
                               {DType::bf16, 1e-2, 1e-2}, {DType::f16, 2e-3, 2e-3}};
  const Tolerance backward[] = {{DType::f64, 1e-10, 1e-10}, {DType::f32, 1e-4, 1e-4},
                                {DType::bf16, 4e-2, 4e-2}, {DType::f16, 1e-2, 1e-2}};
  for (size_t t = 0; t < std::size(forward); ++t) {
    const DType dtype = forward[t].dtype;
    for (const OpCase& op : op_table()) {
      manual_seed(7);
      std::vector<Tensor> gpu_inputs, cpu_inputs;
      for (const Input& in : op.inputs) {
        Tensor gpu = make_input(in, dtype, devs[1]);
        Tensor cpu = gpu.to(kCPU);
        if (is_floating(gpu.dtype())) {
          gpu = gpu.detach().set_requires_grad(true);
          cpu = cpu.detach().set_requires_grad(true);
        }
        gpu_inputs.push_back(gpu);
        cpu_inputs.push_back(cpu);
      }
      const std::string what = op.name + " cuda vs cpu in " + name(dtype);
      const Tensor gpu_out = op.run(gpu_inputs), cpu_out = op.run(cpu_inputs);
      CHECK(gpu_out.device() == devs[1]);
      CHECK(gpu_out.dtype() == cpu_out.dtype());
      check_close(gpu_out, Host::of(cpu_out), forward[t].rtol, forward[t].atol, what);
      if (!gpu_out.requires_grad()) continue;
      const Tensor w = randn(cpu_out.shape(), DType::f64);
      sum(cpu_out.to(DType::f64) * w).backward();
      sum(gpu_out.to(DType::f64) * w.to(devs[1])).backward();
      for (size_t i = 0; i < gpu_inputs.size(); ++i) {
        if (!gpu_inputs[i].requires_grad()) continue;
        REQUIRE(gpu_inputs[i].grad().defined() == cpu_inputs[i].grad().defined());
        if (!gpu_inputs[i].grad().defined()) continue;
        CHECK(gpu_inputs[i].grad().device() == devs[1]);
        check_close(gpu_inputs[i].grad(), Host::of(cpu_inputs[i].grad()), backward[t].rtol, backward[t].atol,
                    what + ", gradient of input " + std::to_string(i));
      }
    }
  }
}

TEST_CASE("integer and bool ops are exact") {
  const Tensor a = tensor<int64_t>({1, -2, 3, 4, 5, -6}, {2, 3});
  const Tensor b = tensor<int64_t>({10, 20, 30}, {3});
  CHECK((a + b).to_vector<int64_t>() == std::vector<int64_t>{11, 18, 33, 14, 25, 24});
  CHECK((a * 2.0).to_vector<int64_t>() == std::vector<int64_t>{2, -4, 6, 8, 10, -12});
  CHECK(abs(a).to_vector<int64_t>() == std::vector<int64_t>{1, 2, 3, 4, 5, 6});
  CHECK(sum(a).item<int64_t>() == 5);
  CHECK(sum(a, {0}).to_vector<int64_t>() == std::vector<int64_t>{5, 3, -3});
  CHECK(max(a, {1}).to_vector<int64_t>() == std::vector<int64_t>{3, 5});
  const Tensor a32 = a.to(DType::i32);
  CHECK(sum(a32).dtype() == DType::i64);
  CHECK(maximum(a32, tensor<int32_t>({0})).to_vector<int32_t>() == std::vector<int32_t>{1, 0, 3, 4, 5, 0});

  const Tensor t = tensor<bool>({true, false, true});
  const Tensor f = tensor<bool>({false, false, true});
  CHECK(logical_and(t, f).to_vector<bool>() == std::vector<bool>{false, false, true});
  CHECK(logical_or(t, f).to_vector<bool>() == std::vector<bool>{true, false, true});
  CHECK(logical_not(t).to_vector<bool>() == std::vector<bool>{false, true, false});
  CHECK(sum(t).item<int64_t>() == 2);
  CHECK(sum(t).dtype() == DType::i64);
}

TEST_CASE("integer overflow wraps and float -> int saturates, the same on every device") {
  // C++ leaves both undefined; the GPU's instructions wrap and saturate, and so does the CPU.
  constexpr int64_t i64_max = INT64_MAX, i64_min = INT64_MIN;
  constexpr int32_t i32_max = INT32_MAX, i32_min = INT32_MIN;
  const double nan = std::nan(""), inf = INFINITY;
  for (Device device : devices()) {
    INFO("on " << device.str());
    const Tensor big = tensor<int64_t>({i64_max, i64_min, i64_min}).to(device);
    CHECK((big + 1.0).to_vector<int64_t>() == std::vector<int64_t>{i64_min, i64_min + 1, i64_min + 1});
    CHECK((big - 1.0).to_vector<int64_t>() == std::vector<int64_t>{i64_max - 1, i64_max, i64_max});
    CHECK((big * 2.0).to_vector<int64_t>() == std::vector<int64_t>{-2, 0, 0});
    CHECK((-big).to_vector<int64_t>() == std::vector<int64_t>{-i64_max, i64_min, i64_min});
    CHECK(abs(big).to_vector<int64_t>() == std::vector<int64_t>{i64_max, i64_min, i64_min});
    CHECK(sum(big.narrow(0, 0, 1) + tensor<int64_t>({0, 1}).to(device)).item<int64_t>() == -1);  // max + (max + 1) wraps
    const Tensor small = tensor<int32_t>({i32_max, i32_min}).to(device);
    CHECK((small + 1.0).to_vector<int32_t>() == std::vector<int32_t>{i32_min, i32_min + 1});
    CHECK((small * 3.0).to_vector<int32_t>() == std::vector<int32_t>{i32_max - 2, i32_min});

    const Tensor floats = tensor<double>({nan, inf, -inf, 1e30, -1e30, 3.7, -3.7, 9.3e18}).to(device);
    CHECK(floats.to(DType::i64).to_vector<int64_t>() ==
          std::vector<int64_t>{0, i64_max, i64_min, i64_max, i64_min, 3, -3, i64_max});
    CHECK(floats.to(DType::i32).to_vector<int32_t>() ==
          std::vector<int32_t>{0, i32_max, i32_min, i32_max, i32_min, 3, -3, i32_max});
    CHECK(floats.to(DType::f32).to(DType::i32).to_vector<int32_t>() ==
          std::vector<int32_t>{0, i32_max, i32_min, i32_max, i32_min, 3, -3, i32_max});
    // A fill value the dtype cannot hold is refused, as a scalar operand is (it saturated;
    // PyTorch: "value cannot be converted ... without overflow").
    CHECK_THROWS_WITH_AS(full({2}, 1e300, TensorOptions(DType::i32).device(device)),
                         doctest::Contains("fill_: the value 1e+300 does not fit i32[2]"), Error);
    CHECK_THROWS_AS(full({2}, NAN, TensorOptions(DType::i64).device(device)), Error);
    CHECK_THROWS_AS(full({2}, 1e6, TensorOptions(DType::f16).device(device)), Error);
    CHECK(full({1}, -INFINITY, TensorOptions(DType::f16).device(device)).to_vector<float>()[0] == -INFINITY);
    // Float negation flips the sign bit: -0.0 for 0.0 (was +0.0, from 0 - x).
    for (DType dtype : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
      const std::vector<double> negated = (-zeros({1}, TensorOptions(dtype).device(device))).to_vector<double>();
      CHECK(std::signbit(negated[0]));
    }
  }
}

TEST_CASE("a zero-size last dim: empty results where the op is defined, an error naming the op where not") {
  // Before, each of these failed inside a view(-1, 0) with a message about view.
  for (Device device : devices()) {
    INFO("on " << device.str());
    const TensorOptions options = TensorOptions(DType::f32).device(device);
    const Tensor x = zeros({2, 0}, options).set_requires_grad(true);
    CHECK(softmax(x, -1).shape() == Shape{2, 0});
    sum(log_softmax(x, -1)).backward();
    CHECK(x.grad().shape() == Shape{2, 0});
    // x W^T over no features is an empty sum: the output is the bias.
    const Tensor bias = tensor<float>({1, 2, 3}).to(device);
    CHECK(linear(zeros({2, 0}, options), zeros({3, 0}, options), bias).to_vector<float>() ==
          std::vector<float>{1, 2, 3, 1, 2, 3});
    CHECK(linear(zeros({2, 0}, options), zeros({3, 0}, options), bias, Activation::gelu).shape() == Shape{2, 3});
    CHECK_THROWS_WITH_AS(layer_norm(zeros({2, 0}, options), Tensor(), Tensor()),
                         doctest::Contains("layer_norm: cannot normalise over a zero-size last dim"), Error);
    CHECK_THROWS_WITH_AS(add_layer_norm(zeros({2, 0}, options), zeros({2, 0}, options), Tensor(), Tensor()),
                         doctest::Contains("add_layer_norm: cannot normalise over a zero-size last dim"), Error);
    CHECK_THROWS_WITH_AS(cross_entropy(zeros({2, 0}, options), zeros({2}, TensorOptions(DType::i64).device(device))),
                         doctest::Contains("cross_entropy: logits f32[2, 0]"), Error);
  }
}

TEST_CASE("a 0-d tensor reduces over dim 0 or -1 as its one element, as in PyTorch") {
  // argmax(scalar, 0) was refused as out of range.
  const Tensor x = full({}, 2.5, TensorOptions(DType::f64)).set_requires_grad(true);
  CHECK(argmax(x, 0).item<int64_t>() == 0);
  CHECK(argmin(x, -1, true).shape() == Shape{});
  const Tensor s = sum(x, {0});
  CHECK(s.shape() == Shape{});
  CHECK(max(x, {-1}).item<double>() == 2.5);
  s.backward();
  CHECK(x.grad().item<double>() == 1);
  CHECK_THROWS_WITH_AS(mean(x, {1}), doctest::Contains("mean: dim 1 is out of range for a 0-d tensor"), Error);
}

TEST_CASE("cross_entropy skips ignored targets and is NaN when all are ignored") {
  const Tensor logits = tensor<double>({1, 2, 3, 0, 0, 0, 5, 1, 1}, {3, 3});
  const Tensor target = tensor<int64_t>({2, -100, 0});
  const double expected = ((std::log(std::exp(1) + std::exp(2) + std::exp(3)) - 3) +
                           (std::log(std::exp(5) + 2 * std::exp(1)) - 5)) / 2;
  CHECK(cross_entropy(logits, target).item<double>() == doctest::Approx(expected).epsilon(1e-12));
  CHECK(cross_entropy(logits, tensor<int64_t>({-1, 1, 2}), -1).item<double>() ==
        doctest::Approx((std::log(3.0) + std::log(std::exp(5) + 2 * std::exp(1)) - 1) / 2).epsilon(1e-12));
  CHECK(std::isnan(cross_entropy(logits, tensor<int64_t>({-100, -100, -100})).item<double>()));
}

TEST_CASE("softmax and cross_entropy keep the logsumexp's small part beside a large max, and NaN rows whole") {
  // x - lse was x - (max + log_total): 1e20 + 0.69 is 1e20, so softmax([1e20, 1e20]) was
  // [1, 1] and the cross-entropy 0 with gradient [0, 1] (PyTorch: [0.5, 0.5], 0.693, [-0.5, 0.5]).
  for (const Device device : devices()) {
    INFO(device.str());
    const Tensor big = tensor<double>({1e20, 1e20}, {1, 2}).to(device);
    CHECK(softmax(big, -1).to_vector<double>() == std::vector<double>{0.5, 0.5});
    CHECK(log_softmax(big, -1).to_vector<double>()[0] == doctest::Approx(-std::log(2.0)));
    const Tensor logits = big.detach().set_requires_grad(true);
    const Tensor loss = cross_entropy(logits, tensor<int64_t>({0}).to(device));
    CHECK(loss.item<double>() == doctest::Approx(std::log(2.0)));
    loss.backward();
    CHECK(logits.grad().to_vector<double>() == std::vector<double>{-0.5, 0.5});
    // A loss so large that its f32 rounding sits in every probability's exponent: the
    // backward reads the row again (the gradient was [4.48, -1, 1]).
    const Tensor far = tensor<float>({1.5f, -1e8f, 0.0f}, {1, 3}).to(device).set_requires_grad(true);
    cross_entropy(far, tensor<int64_t>({1}).to(device)).backward();
    const std::vector<float> far_grad = far.grad().to_vector<float>();
    const double p0 = 1 / (1 + std::exp(-1.5));
    CHECK(far_grad[0] == doctest::Approx(p0).epsilon(1e-5));
    CHECK(far_grad[1] == -1.0f);
    CHECK(far_grad[2] == doctest::Approx(1 - p0).epsilon(1e-5));
    // A +inf, or a NaN anywhere, makes the whole row NaN (was [nan, 0, 0] and [nan, nan, 0]).
    for (const std::vector<double>& row : {std::vector<double>{INFINITY, 1, 2}, std::vector<double>{NAN, INFINITY, 1},
                                           std::vector<double>{1, 2, NAN}})
      for (const double v : softmax(tensor<double>(row).to(device), -1).to_vector<double>()) CHECK(std::isnan(v));
  }
}

TEST_CASE("edge cases as PyTorch: maximum's gradient beside NaN, a zero-size split, 0-d dims, meta arange") {
  // maximum(NaN, 1): neither input lost, so both take the gradient (b took all of it).
  const Tensor a = tensor<double>({NAN, 3}).set_requires_grad(true), b = tensor<double>({1, 3}).set_requires_grad(true);
  sum(maximum(a, b)).backward();
  CHECK(a.grad().to_vector<double>() == std::vector<double>{1, 0.5});
  CHECK(b.grad().to_vector<double>() == std::vector<double>{1, 0.5});
  const std::vector<Tensor> parts = split(zeros({0, 3}), 2, 0);  // one empty part (was none)
  REQUIRE(parts.size() == 1);
  CHECK(parts[0].shape() == Shape{0, 3});
  const Tensor scalar = full({}, 1.0);
  CHECK_THROWS_WITH_AS(softmax(scalar, 5), doctest::Contains("softmax: dim 5 is out of range for a 0-d tensor"), Error);
  CHECK_THROWS_WITH_AS(sum(scalar, {0, -1}), doctest::Contains("name the one dim of a 0-d tensor more than once"), Error);
  CHECK_THROWS_WITH_AS(zeros({3}).unsqueeze(2),
                       "unsqueeze: dim 2 is out of range for f32[3] on cpu (a new dim goes at -2 to 1)", Error);
  // On the meta device nothing is written: arange built the whole range on the host first.
  CHECK(arange(0.0, 1e17, 1.0, TensorOptions(DType::i64).device(kMeta)).numel() == int64_t(1e17));
}

TEST_CASE("pow's gradients at a = 0 are the limits PyTorch takes, not 0 * inf") {
  const Tensor a = tensor<double>({0, 0, 2}).set_requires_grad(true), b = tensor<double>({0, 2, 0}).set_requires_grad(true);
  sum(pow(a, b)).backward();
  CHECK(a.grad().to_vector<double>() == std::vector<double>{0, 0, 0});  // d/da a^0 = 0; d/da a^2 = 0 at 0
  CHECK(b.grad().to_vector<double>() == std::vector<double>{0, 0, std::log(2.0)});  // 0^b for b >= 0: 0
  const Tensor x = tensor<double>({0, 3}).set_requires_grad(true);
  sum(pow(x, 0.0)).backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{0, 0});
}

TEST_CASE("relu passes NaN through, as PyTorch does") {
  // It gave 0 for NaN, hiding a diverged activation.
  for (const Device device : devices()) {
    INFO(device.str());
    const Tensor x = tensor<float>({1, NAN, -2, 0}).to(device).set_requires_grad(true);
    const Tensor y = relu(x);
    const std::vector<float> out = y.to_vector<float>();
    CHECK(out[0] == 1);
    CHECK(std::isnan(out[1]));
    CHECK(out[2] == 0);
    CHECK(out[3] == 0);
    sum(y).backward();  // PyTorch's threshold_backward: g unless x <= 0
    CHECK(x.grad().to_vector<float>() == std::vector<float>{1, 1, 0, 0});
  }
}

TEST_CASE("cross_entropy of 16-bit logits is an f32 loss that a GradScaler can scale") {
  // It was cast back to the logits' dtype: an f16 loss times 65536 was inf for any loss above 1.
  for (const DType dtype : {DType::f16, DType::bf16}) {
    INFO(std::string(name(dtype)));
    const Tensor logits = tensor<float>({0, 0, 0, 0, 5, 0}, {2, 3}).to(dtype).set_requires_grad(true);
    const Tensor loss = cross_entropy(logits, tensor<int64_t>({1, 0}));
    CHECK(loss.dtype() == DType::f32);
    const double want = (std::log(3.0) + 5 + std::log1p(2 * std::exp(-5.0))) / 2;
    CHECK(loss.item<double>() == doctest::Approx(want).epsilon(1e-6));
    (loss * 65536.0).backward();
    CHECK(std::isfinite(max(abs(logits.grad().to(DType::f32))).item<double>()));
    CHECK(logits.grad().dtype() == dtype);
  }
}

TEST_CASE("cross_entropy of a -inf target logit: the loss is inf and the gradient softmax - onehot, as in PyTorch") {
  // The backward rebuilt the logsumexp as loss + x[t] = inf - inf: a NaN row.
  for (const Device device : devices()) {
    INFO(device.str());
    const Tensor logits =
        tensor<float>({-INFINITY, 0, 0, 1, 2, 3}, {2, 3}).to(device).set_requires_grad(true);
    const Tensor loss = cross_entropy(logits, tensor<int64_t>({0, 2}).to(device));
    CHECK(std::isinf(loss.item<float>()));
    loss.backward();
    const std::vector<float> grad = logits.grad().to_vector<float>();
    const double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
    const std::vector<double> want{-0.5, 0.25, 0.25, std::exp(1.0) / z / 2, std::exp(2.0) / z / 2,
                                   (std::exp(3.0) / z - 1) / 2};
    for (size_t j = 0; j < want.size(); ++j) CHECK(grad[j] == doctest::Approx(want[j]).epsilon(1e-6));
  }
}

TEST_CASE("mlp is linear with GELU then linear, forward and backward, keeping less") {
  // Its backward makes the GELU output again instead of keeping it: bit for bit where both
  // paths take the same kernels (the CPU). On a GPU the forward's GELU comes from a GEMM
  // epilogue and the recompute's from the gelu kernel, so the gradients part ways within
  // roundings; each is checked against what they can move it by, |error| <= eps * (the same
  // sums over absolute values): a bound that does not shrink where a gradient's terms cancel.
  // (A backend may also form dp = (g W2) * gelu'(p) its own way: the bounds allow for that.)
  for (const Device device : devices()) {
    for (const DType dt : {DType::f32, DType::bf16}) {
      manual_seed(6);
      const TensorOptions options = TensorOptions(dt).device(device);
      const std::vector<Tensor> inputs{randn({2, 5, 16}, options), randn({64, 16}, options), randn({64}, options),
                                       randn({16, 64}, options), randn({16}, options)};
      const Tensor g = randn({2, 5, 16}, options);
      std::vector<Tensor> outs;
      std::vector<std::vector<Tensor>> grads;
      for (const bool fused : {true, false}) {
        std::vector<Tensor> x;
        for (const Tensor& t : inputs) x.push_back(t.detach().set_requires_grad(true));
        const Tensor y = fused ? mlp(x[0], x[1], x[2], x[3], x[4])
                               : linear(linear(x[0], x[1], x[2], Activation::gelu), x[3], x[4]);
        sum(y * g).backward();
        outs.push_back(y.detach());
        grads.emplace_back();
        for (const Tensor& t : x) grads.back().push_back(t.grad());
      }
      const std::string what = std::string(" on ") + device.str() + " in " + name(dt);
      check_identical(outs[0], outs[1], "output" + what);
      check_identical(grads[0][4], grads[1][4], "gradient of input 4" + what);  // sum over rows of g, both ways
      if (device == kCPU) {
        for (size_t i = 0; i < 4; ++i) check_identical(grads[0][i], grads[1][i], "gradient of input " + std::to_string(i) + what);
        continue;
      }
      // In f64 from the same inputs: pre = x W1^T + b1, h = gelu(pre), dh = g W2, s = gelu'(pre).
      // dp = dh s may move by eps |dh| (|s| + 1) (roundings of dh and of dp; an approximate
      // gelu'), h by eps (|h| + |pre|) (roundings of pre and h; the epilogue's approximate GELU).
      // eps: bf16, a few roundings of 2^-9; f32, 2^-11, the hardware tanh's relative error.
      auto f64 = [](const Tensor& t) { return t.to(kCPU).to(DType::f64); };
      const Tensor x = f64(inputs[0]).view({10, 16}), w1 = f64(inputs[1]), g2 = f64(g).view({10, 16});
      const Tensor pre = linear(x, w1, f64(inputs[2]));
      const Tensor dh = matmul(g2, f64(inputs[3]));
      const Tensor dp_scale = abs(dh) * (abs(gelu_backward(pre, ones_like(pre))) + 1.0);
      const std::vector<Tensor> scales{matmul(dp_scale, abs(w1)).view({2, 5, 16}),
                                       matmul(dp_scale, abs(x), /*trans_a=*/true), sum(dp_scale, {0}),
                                       matmul(abs(g2), abs(gelu(pre)) + abs(pre), /*trans_a=*/true)};
      const double eps = dt == DType::bf16 ? 1.0 / 64 : 1.0 / 2048;
      for (size_t i = 0; i < scales.size(); ++i) {
        const std::string which = "gradient of input " + std::to_string(i) + what;
        const double worst = max(abs(f64(grads[0][i]) - f64(grads[1][i])) / scales[i]).item<double>();
        MESSAGE(which << ": worst |fused - unfused| / bound-without-eps = " << worst);
        CHECK(worst <= eps);
      }
    }
  }
  // Kept for backward: x and the [rows, 4C] pre-activation, not the GELU output too.
  Context rank;
  ContextGuard guard(rank);
  const TensorOptions meta = TensorOptions(DType::bf16).device(kMeta);
  const Tensor x = randn({8, 16}, meta).set_requires_grad(true);
  const Tensor fc = randn({64, 16}, meta), proj = randn({16, 64}, meta);
  const int64_t before = memory_stats(kMeta).allocated_total;
  const Tensor y = mlp(x, fc, Tensor(), proj, Tensor());
  CHECK(memory_stats(kMeta).allocated_total - before == y.nbytes() + 8 * 64 * 2);
}

TEST_CASE("the CPU's fused f32 attention matches the composed f64 path, forward and backward, masked or not") {
  // f32 takes tensor/cpu/attention.cpp (query blocks of 64: T = 150 makes three, the last
  // partial); f64 stays composed (matmul, mask, softmax). q, k, v are [B, T, H, D] buffers
  // seen as [B, H, T, D]; keys may be fewer than queries, or more.
  for (const bool causal : {false, true})
    for (const int64_t keys : {int64_t(150), int64_t(97), int64_t(200)}) {
      INFO("causal " << causal << " keys " << keys);
      manual_seed(11);
      const int64_t batch = 2, heads = 3, queries = 150, head = 16;
      const Tensor q64 = randn({batch, queries, heads, head}, DType::f64), k64 = randn({batch, keys, heads, head}, DType::f64);
      const Tensor v64 = randn({batch, keys, heads, head}, DType::f64), g64 = randn({batch, heads, queries, head}, DType::f64);
      std::vector<Tensor> results[2];
      for (const DType dt : {DType::f64, DType::f32}) {
        std::vector<Tensor> leaves;
        for (const Tensor& t : {q64, k64, v64}) leaves.push_back(t.to(dt).detach().set_requires_grad(true));
        const Tensor y = scaled_dot_product_attention(leaves[0].transpose(1, 2), leaves[1].transpose(1, 2),
                                                      leaves[2].transpose(1, 2), causal);
        sum(y * g64.to(dt)).backward();
        results[dt == DType::f32] = {y.detach(), leaves[0].grad(), leaves[1].grad(), leaves[2].grad()};
      }
      const char* names[] = {"out", "dq", "dk", "dv"};
      for (int i = 0; i < 4; ++i) {
        const std::string what = names[i];
        INFO(what);
        const double error = max(abs(results[1][i].to(DType::f64) - results[0][i])).item<double>();
        CHECK(error < 2e-5 * (1 + max(abs(results[0][i])).item<double>()));
      }
    }
}

TEST_CASE("the CPU's vectorised f32 GELU and its gradient are within a few ulp of the f64 ones") {
  // tensor/cpu/elementwise.cpp's gelu_f32 (contiguous f32) against the scalar f64 path, over
  // x in [-12, 12]: the backward's 1 - tanh^2 u stays accurate where 1 - t*t would cancel
  // (|x| of 2 to 5, the tail the GPU kernels are checked against).
  const int64_t n = 200'001;
  const Tensor x64 = arange(n, DType::f64) * (24.0 / (n - 1)) - 12.0, g64 = ones({n}, DType::f64);
  const Tensor x = x64.to(DType::f32), g = g64.to(DType::f32);
  const Tensor ref_y = gelu(x.to(DType::f64)), ref_dx = gelu_backward(x.to(DType::f64), g64);
  const std::pair<Tensor, Tensor> pairs[] = {{gelu(x), ref_y}, {gelu_backward(x, g), ref_dx}};
  for (const auto& [got, want] : pairs) {
    // in f32 ulps of the reference's magnitude, or of 1 below it (dx crosses zero near
    // x = -0.75, where its two terms cancel). Eigen's tanh with 1 - t*t read 35 at x = -4.8.
    const Tensor ulps = abs(got.to(DType::f64) - want) / (maximum(abs(want), ones({n}, DType::f64)) * 0x1p-23);
    CHECK(max(ulps).item<double>() < 8.0);
  }
}

TEST_CASE("the CPU's f32 GEMM of each ISA build matches f64 over edge tiles, strides, and k, n past a block") {
  // tensor/cpu/gemm.inc: tiles of 6 x 16 (6 x 8 portable), blocks of k 256, n 3072, m 144.
  // Bound: |C - C64| <= k 2^-23 (|A| |B|), the worst case of a k-term f32 dot product.
  std::vector<const cpu::VectorKernels*> builds{&cpu::portable::kernels};
#if defined(__x86_64__)
  if (cpu::cpu_isa() != cpu::Isa::portable) builds.push_back(&cpu::avx2::kernels);
#endif
  struct Case { int64_t m, n, k; bool trans_a, trans_b; };
  const Case cases[] = {{1, 1, 1, false, false},    {7, 17, 5, false, false},   {150, 40, 300, true, false},
                        {13, 3100, 20, false, true}, {145, 33, 600, true, true}, {6, 16, 256, false, false}};
  for (const Case& c : cases) {
    manual_seed(11);
    const Tensor a64 = c.trans_a ? randn({1, c.k, c.m}, DType::f64).transpose(1, 2) : randn({1, c.m, c.k}, DType::f64);
    const Tensor b64 = c.trans_b ? randn({1, c.n, c.k}, DType::f64).transpose(1, 2) : randn({1, c.k, c.n}, DType::f64);
    const Tensor a = a64.to(DType::f32), b = b64.to(DType::f32);
    const Tensor want = matmul(a.to(DType::f64), b.to(DType::f64)), scale = matmul(abs(a64), abs(b64));
    for (const cpu::VectorKernels* build : builds) {
      const Tensor got = empty({1, c.m, c.n});
      build->matmul(a, b, got);
      INFO("m " << c.m << " n " << c.n << " k " << c.k << (c.trans_a ? " A^T" : "") << (c.trans_b ? " B^T" : ""));
      CHECK(max(abs(got.to(DType::f64) - want) / scale).item<double>() <= c.k * 0x1p-23);
    }
  }
}

TEST_CASE("packed_attention is split + scaled_dot_product_attention, forward and backward, on every device") {
  // [B, T, 3C] with C = H * D; D = 64 and 16-bit dtypes take cuDNN's fused kernels on a GPU.
  const int64_t batch = 2, time = 16, heads = 2, head = 64, channels = heads * head;
  for (const Device device : devices()) {
    for (const DType dt : {DType::f32, DType::bf16}) {
      manual_seed(5);
      const Tensor qkv = randn({batch, time, 3 * channels}, TensorOptions(dt).device(device));
      const Tensor g = randn({batch, time, channels}, TensorOptions(dt).device(device));
      std::vector<Tensor> outs, grads;
      for (const bool packed : {true, false}) {
        const Tensor x = qkv.detach().set_requires_grad(true);
        Tensor y;
        if (packed) {
          y = packed_attention(x, heads, true);
        } else {
          const std::vector<Tensor> parts = split(x, channels, 2);
          auto heads_of = [&](const Tensor& t) { return t.view({batch, time, heads, head}).transpose(1, 2); };
          y = scaled_dot_product_attention(heads_of(parts[0]), heads_of(parts[1]), heads_of(parts[2]), true)
                  .transpose(1, 2)
                  .reshape({batch, time, channels});
        }
        sum(y * g).backward();
        outs.push_back(y.detach());
        grads.push_back(x.grad());
      }
      const std::string what = std::string(" on ") + device.str() + " in " + name(dt);
      check_identical(outs[0], outs[1], "output" + what);
      check_identical(grads[0], grads[1], "gradient" + what);
    }
  }
  CHECK_THROWS_WITH_AS(packed_attention(zeros({2, 3, 12}), 5, true),
                       "packed_attention: expected qkv [B, T, 3 * 5 heads * D] with D > 0, got f32[2, 3, 12] on cpu",
                       Error);
}

TEST_CASE("matmul's gradients reach a transposed input in its own layout") {
  // The tied LM head multiplies by wte^T: its gradient came back as a transposed view of
  // x^T g, and the add into wte.grad read it with a stride of the vocabulary.
  for (const Device device : devices()) {
    const Tensor x = randn({6, 4}, TensorOptions(DType::f64).device(device)).set_requires_grad(true);
    const Tensor w = randn({5, 4}, TensorOptions(DType::f64).device(device)).set_requires_grad(true);
    bool contiguous_x = false, contiguous_w = false;
    x.register_hook([&](const Tensor& g) { return contiguous_x = g.is_contiguous(), Tensor(); });
    w.register_hook([&](const Tensor& g) { return contiguous_w = g.is_contiguous(), Tensor(); });
    const Tensor g = randn({6, 5}, TensorOptions(DType::f64).device(device));
    sum(matmul(x, w, false, true) * g).backward();
    CHECK(contiguous_w);
    CHECK(contiguous_x);
    check_close(w.grad(), Host::of(matmul(g, x, true, false)), 1e-12, 1e-12, "dW = g^T x");
    check_close(x.grad(), Host::of(matmul(g, w.detach())), 1e-12, 1e-12, "dx = g W");
    const Tensor a = randn({4, 6}, TensorOptions(DType::f64).device(device)).set_requires_grad(true);  // a transposed on the left
    sum(matmul(a, w, true, true) * g).backward();
    check_close(a.grad(), Host::of(matmul(w.detach(), g, true, true)), 1e-12, 1e-12, "dA = (g W)^T");
  }
}

TEST_CASE("layer_norm returns the statistics backward needs") {
  const Tensor x = tensor<float>({1, 2, 3, 4, 10, 10, 10, 10}, {2, 4});
  const LayerNormOutput r = layer_norm_with_stats(x, Tensor(), Tensor(), 1e-5);
  CHECK(r.mean.dtype() == DType::f32);
  CHECK(r.mean.to_vector<float>() == std::vector<float>{2.5f, 10.0f});
  CHECK(r.rstd.to_vector<float>()[0] == doctest::Approx(1 / std::sqrt(1.25 + 1e-5)));
  CHECK(r.rstd.to_vector<float>()[1] == doctest::Approx(1 / std::sqrt(1e-5)));
}

TEST_CASE("add_layer_norm gives the values and gradients of the add and the layer norm apart") {
  for (DType dt : {DType::f32, DType::bf16}) {
    manual_seed(3);
    const Tensor x = randn({2, 5, 12}, dt), r = randn({2, 5, 12}, dt), w = randn({12}, dt), b = randn({12}, dt);
    const Tensor g_sum = randn({2, 5, 12}, dt), g_out = randn({2, 5, 12}, dt);
    std::vector<std::vector<Tensor>> grads;
    std::vector<Tensor> values;
    for (const bool fused : {true, false}) {
      std::vector<Tensor> leaves{x, r, w, b};
      for (Tensor& t : leaves) t = t.detach().set_requires_grad(true);
      Tensor sum_, out;
      if (fused) {
        const AddLayerNormOutput o = add_layer_norm(leaves[0], leaves[1], leaves[2], leaves[3]);
        sum_ = o.sum, out = o.out;
      } else {
        sum_ = leaves[0] + leaves[1];
        out = layer_norm(sum_, leaves[2], leaves[3]);
      }
      values.push_back(sum_.detach());
      values.push_back(out.detach());
      (sum(sum_ * g_sum) + sum(out * g_out)).backward();
      grads.emplace_back();
      for (const Tensor& t : leaves) grads.back().push_back(t.grad());
    }
    const std::string in = std::string(" in ") + name(dt);
    check_identical(values[0], values[2], "sum" + in);
    check_identical(values[1], values[3], "out" + in);
    for (size_t i = 0; i < 4; ++i) check_identical(grads[0][i], grads[1][i], "gradient " + std::to_string(i) + in);
  }
  CHECK_THROWS_WITH_AS(add_layer_norm(zeros({2, 3}), zeros({3}), Tensor(), Tensor()),
                       "add_layer_norm: x and residual must have one shape, got f32[2, 3] on cpu and f32[3] on cpu",
                       Error);
  CHECK_THROWS_WITH_AS(add_layer_norm(zeros({2, 3}), zeros({2, 3}, DType::f64), Tensor(), Tensor()),
                       doctest::Contains("add_layer_norm"), Error);
}

TEST_CASE("softmax is stable for large inputs and max propagates NaN") {
  const Tensor big = tensor<float>({1000, 1001, 1002});
  const auto p = softmax(big).to_vector<float>();
  CHECK(p[2] == doctest::Approx(std::exp(0.0) / (std::exp(-2.0) + std::exp(-1.0) + 1)));
  CHECK(std::isnan(max(tensor<float>({1, NAN, 3})).item<float>()));
  CHECK(argmax(tensor<float>({1, NAN, 3})).item<int64_t>() == 1);
  CHECK(std::isnan(mean(zeros({0})).item<double>()));
}

TEST_CASE("cat and split are inverse") {
  const Tensor x = arange(0.0, 24.0, 1.0, DType::f32).view({4, 6});
  const auto parts = split(x, 4, 1);
  REQUIRE(parts.size() == 2);
  CHECK(parts[0].shape() == Shape{4, 4});
  CHECK(parts[1].shape() == Shape{4, 2});
  CHECK(cat(parts, 1).to_vector<float>() == x.to_vector<float>());
  const auto rows = split(x, Shape{1, 3}, 0);
  CHECK(rows[1].shape() == Shape{3, 6});
  CHECK(rows[1].storage() == x.storage());  // views, not copies
  CHECK(cat({rows[1], rows[0]}, 0).to_vector<float>()[0] == 6.0f);
}

}  // namespace zg::test

namespace zg::test {

TEST_CASE("issue 43's ops on integers, bools and edges: exact values, as PyTorch") {
  for (Device device : devices()) {
    INFO("on " << device.str());
    const TensorOptions i32 = TensorOptions(DType::i32).device(device), f64 = TensorOptions(DType::f64).device(device);
    const Tensor ints = tensor<int32_t>({1, -2, 3, 4, 5, -6}, {2, 3}, i32);
    CHECK(cumsum(ints, 1).dtype() == DType::i64);
    CHECK(cumsum(ints, 1).to_vector<int64_t>() == std::vector<int64_t>{1, -1, 2, 4, 9, 3});
    CHECK(cumsum(ints, 0).to_vector<int64_t>() == std::vector<int64_t>{1, -2, 3, 5, 3, -3});
    const Tensor flags = tensor<bool>({true, false, true, true}).to(device);
    CHECK(cumsum(flags, 0).to_vector<int64_t>() == std::vector<int64_t>{1, 1, 2, 3});
    CHECK(cumsum(full({}, 2.5, f64), 0).item<double>() == 2.5);
    CHECK(cumsum(zeros({3, 0}, f64), 1).shape() == Shape{3, 0});
    CHECK(cumsum(ones({600}, f64), 0).to_vector<double>().back() == 600);  // past one tile of a GPU block scan
    const Tensor big = tensor<int64_t>({INT64_MAX, 1}).to(device);
    CHECK(cumsum(big, 0).to_vector<int64_t>() == std::vector<int64_t>{INT64_MAX, INT64_MIN});  // wraps, as a sum does

    // log1p keeps the digits log(1 + x) loses.
    CHECK(log1p(full({1}, 1e-10, f64)).item<double>() == doctest::Approx(std::log1p(1e-10)).epsilon(1e-15));
    CHECK(log1p(full({1}, -1.0, f64)).item<double>() == -INFINITY);

    const Tensor specials = tensor<double>({1.0, NAN, INFINITY, -INFINITY, 0.0}).to(device);
    CHECK(isnan(specials).to_vector<bool>() == std::vector<bool>{false, true, false, false, false});
    CHECK(isinf(specials).to_vector<bool>() == std::vector<bool>{false, false, true, true, false});
    CHECK(isnan(ints).to_vector<bool>() == std::vector<bool>(6, false));
    CHECK(isinf(ints).dtype() == DType::boolean);
    CHECK(isinf(ints).to_vector<bool>() == std::vector<bool>(6, false));
    CHECK(any(specials).item<bool>());
    CHECK_FALSE(all(specials).item<bool>());
    CHECK(all(specials.narrow(0, 0, 4)).item<bool>());  // NaN and inf are non-zero
    CHECK(any(tensor<bool>({false, true, false, false}, {2, 2}).to(device), {1}).to_vector<bool>() ==
          std::vector<bool>{true, false});
    CHECK_FALSE(any(zeros({0}, f64)).item<bool>());  // over nothing: any false, all true
    CHECK(all(zeros({0}, f64)).item<bool>());
    CHECK(all(ints, {0}, true).shape() == Shape{1, 3});

    CHECK(norm(tensor<double>({3, 0, -4, 0}).to(device), 0).item<double>() == 2);  // the count of non-zeros
    CHECK(norm(tensor<double>({3, -4}).to(device), -INFINITY).item<double>() == 3);
    // A zero vector: the norm's gradient is 0 and normalize's 1 / eps, not NaN (as PyTorch's).
    const Tensor zero = zeros({2, 3}, f64).set_requires_grad(true);
    sum(norm(zero, 2, {1}) + norm(zero, 3, {1})).backward();
    CHECK(zero.grad().to_vector<double>() == std::vector<double>(6, 0.0));
    const Tensor z2 = zeros({2, 3}, f64).set_requires_grad(true);
    sum(normalize(z2, 2, 1, 1e-6)).backward();
    for (double g : z2.grad().to_vector<double>()) CHECK(g == doctest::Approx(1e6));
    // softplus takes x itself above the threshold, with no overflow on the branch it leaves out.
    const Tensor large = tensor<double>({1000.0, -1000.0}).to(device).set_requires_grad(true);
    const Tensor soft = softplus(large);
    CHECK(soft.to_vector<double>() == std::vector<double>{1000.0, 0.0});
    sum(soft).backward();
    CHECK(large.grad().to_vector<double>() == std::vector<double>{1.0, 0.0});

    CHECK(chunk(zeros({7, 2}, f64), 3).size() == 3);
    CHECK(chunk(zeros({6, 2}, f64), 4).size() == 3);  // pieces of 2: fewer than asked, as torch.chunk
    CHECK(chunk(zeros({0}, f64), 2).size() == 1);
    CHECK(unbind(zeros({2, 3}, f64), 1).size() == 3);
    const Tensor m = tensor<double>({1, 2, 3, 4, 5, 6}, {2, 3}, f64);
    CHECK(einsum("ij->", {m}).item<double>() == 21);
    CHECK(einsum("ij,ij->i", {m, m}).to_vector<double>() == std::vector<double>{14, 77});
    CHECK(einsum("ji", {m}).to_vector<double>() == std::vector<double>{1, 4, 2, 5, 3, 6});  // implicit "ij": the transpose
    CHECK(einsum("ij,kj", {m, m}).to_vector<double>() == std::vector<double>{14, 32, 32, 77});  // i, k used once
    CHECK(repeat(ints, {2, 1}).to_vector<int32_t>() == std::vector<int32_t>{1, -2, 3, 4, 5, -6, 1, -2, 3, 4, 5, -6});
    CHECK(repeat(ints, {0, 1}).shape() == Shape{0, 3});
    CHECK(pad(ints, {1, 0}, PadMode::constant, 9).to_vector<int32_t>() == std::vector<int32_t>{9, 1, -2, 3, 9, 4, 5, -6});
    CHECK(pad(ints, {0, 1}, PadMode::replicate).to_vector<int32_t>() == std::vector<int32_t>{1, -2, 3, 3, 4, 5, -6, -6});
  }
}

TEST_CASE("issue 43's ops refuse bad arguments with an error naming the op") {
  const Tensor x = randn({2, 3}, DType::f64);
  CHECK_THROWS_WITH_AS(cumsum(x, 2), doctest::Contains("cumsum"), Error);
  CHECK_THROWS_WITH_AS(flip(x, {1, -1}), "flip: dim 1 appears more than once in [1, -1]", Error);
  CHECK_THROWS_WITH_AS(repeat(x, {2}), "repeat: [2] gives fewer repeats than f64[2, 3] on cpu has dims", Error);
  CHECK_THROWS_WITH_AS(chunk(x, 0), "chunk: chunks must be positive, got 0", Error);
  CHECK_THROWS_WITH_AS(unbind(full({}, 1.0)), "unbind: cannot unbind a 0-d tensor", Error);
  CHECK_THROWS_WITH_AS(pad(x, {1}), "pad: expected (before, after) pairs for at most the 2 dims of f64[2, 3] on cpu, got [1]",
                       Error);
  CHECK_THROWS_WITH_AS(pad(x, {3, 0}, PadMode::reflect),
                       "pad: reflect pads (3, 0) must be below the size 3 of dim 1 of f64[2, 3] on cpu", Error);
  CHECK_THROWS_WITH_AS(pad(x, {-1, 0}, PadMode::replicate),
                       "pad: replicate mode takes no negative pads, got (-1, 0) for dim 1", Error);
  CHECK_THROWS_WITH_AS(pad(x, {-2, -2}), "pad: pads (-2, -2) leave dim 1 of f64[2, 3] on cpu a negative size", Error);
  CHECK_THROWS_WITH_AS(norm(x, -1), "norm: p must be >= 0, inf or -inf, got -1", Error);
  CHECK_THROWS_WITH_AS(softplus(x, 0.0), "softplus: expected a finite beta > 0 and a threshold, got beta 0 and threshold 20",
                       Error);
  CHECK_THROWS_WITH_AS(leaky_relu(zeros({2}, DType::i64)), doctest::Contains("leaky_relu"), Error);
  CHECK_THROWS_WITH_AS(log1p(zeros({2}, DType::i64)), doctest::Contains("log1p"), Error);
  CHECK_THROWS_WITH_AS(einsum("ii->i", {randn({3, 3}, DType::f64)}),
                       "einsum: \"ii->i\": index 'i' is repeated in operand 0; traces and diagonals are not supported", Error);
  CHECK_THROWS_WITH_AS(einsum("...ij->ij", {x}),
                       "einsum: \"...ij->ij\": ellipsis ('...') is not supported; name every dim with a letter", Error);
  CHECK_THROWS_WITH_AS(einsum("ij,jk->ik", {x}), "einsum: \"ij,jk->ik\" names 2 operands, got 1", Error);
  CHECK_THROWS_WITH_AS(einsum("ijk->i", {x}), "einsum: operand 0 f64[2, 3] on cpu has 2 dims but \"ijk\" names 3", Error);
  CHECK_THROWS_WITH_AS(einsum("ij,ij->i", {x, randn({3, 2}, DType::f64)}),
                       "einsum: \"ij,ij->i\": index 'i' has size 2 in one operand and 3 in operand 1 f64[3, 2] on cpu", Error);
  CHECK_THROWS_WITH_AS(einsum("ij->k", {x}), "einsum: \"ij->k\": output index 'k' names no input dim", Error);
  CHECK_THROWS_WITH_AS(einsum("ij->ii", {x}), "einsum: \"ij->ii\": output index 'i' is repeated", Error);
  CHECK_THROWS_WITH_AS(einsum("i1->i", {x}), "einsum: \"i1->i\": '1' is not an index (letters a-z, A-Z)", Error);
  CHECK_THROWS_WITH_AS(einsum("ij,jk->ik", {x, randn({3, 2})}), doctest::Contains("einsum"), Error);
}

TEST_CASE("gelu_exact in bf16 and f16 rounds once, as PyTorch: the f32 result, rounded") {
  manual_seed(7);
  const Tensor x = randn({4096}) * 3.0;
  for (const DType dtype : {DType::bf16, DType::f16}) {
    INFO(name(dtype));
    const Tensor half = x.to(dtype);
    const Tensor y = gelu_exact(half);
    CHECK(y.dtype() == dtype);
    CHECK(max_abs_diff(y, gelu_exact(half.to(DType::f32)).to(dtype)) == 0.0);
  }
}

}  // namespace zg::test
