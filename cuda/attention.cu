// Fused ("flash") attention on the GPU: cuDNN's scaled-dot-product-attention graphs,
// built through the cuDNN frontend (NVIDIA's header-only C++ API over cuDNN's graph
// backend) and cached per layout in the rank's state.
//
// What it computes, per batch and head, for query rows q_i (i < T), key and value rows
// k_j, v_j (j < S), head size D and scale = 1 / sqrt(D) (the front-end's):
//   s_ij = scale q_i . k_j, or -inf where j > i when causal (the diagonal starts at the
//          top left: query i sees keys 0..i, whatever T and S are)
//   L_i  = log sum_j exp(s_ij)                      (natural log: the stats)
//   p_ij = exp(s_ij - L_i),   out_i = sum_j p_ij v_j
// and from g = d loss / d out, with Delta_i = g_i . out_i = sum_j p_ij (g_i . v_j):
//   dv_j = sum_i p_ij g_i,   ds_ij = p_ij (g_i . v_j - Delta_i),
//   dq_i = scale sum_j ds_ij k_j,   dk_j = scale sum_i ds_ij q_i.
// Flash attention walks the keys tile by tile with a running max and sum per row, so s
// and p -- [T, S] per head -- never reach memory: the forward keeps the O(T) row
// statistics L instead of the O(T S) probabilities the composite path saves, and the
// backward recomputes p tile by tile from q, k and L. (On Hopper the backward may still
// take a transient workspace for dP, 2 B H T S bytes, when that is at most 256 MiB: the
// frontend's default, environment variable CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT.)
//
// The stats: cuDNN's training forward (generate_stats) writes, per row, the max of s
// plus the natural log of the sum of exp(s - max) -- L_i above -- in fp32 as
// [B, H, T, 1] (the frontend converts to base 2 only when asked, set_stats_use_log2,
// which we never do), and its backward reads exactly that to recompute p. Our
// [B, H, T] f32 stats are that tensor.
//
// Engines: heuristics mode A, the first plan that builds. The forward is cuDNN's
// "composite" SDPA graph, the flash-attention forward that sdpa_backward is the backward
// of, rather than the "unified" node the frontend picks on some cuDNN versions, so the
// two stay one family whatever cuDNN is installed. The backward adds up dq with atomics:
// not bitwise deterministic (cuDNN's deterministic mode on Hopper costs a [T, S]
// workspace).
//
// A graph is built once per layout -- dtype, mask, scale, every operand's dims and
// strides -- since building chooses and compiles an engine (milliseconds to seconds)
// while executing only queues kernels; a layout cuDNN refuses is remembered with its
// reason and not asked again (while among the most recently used: AttentionGraphs).
// attention() says yes only once the backward graph that will follow builds too (when
// q, k or v requires grad: otherwise none can follow), for the layouts the front-end
// will pass, because attention_backward cannot decline. (Evicted in between, that graph
// is built again by the backward: it built once for this very layout.)
#include "cuda/attention.h"
#include "cuda/backend.h"

#ifdef ZG_HAVE_CUDNN_FRONTEND

#include <cstring>  // before the frontend: built without its JSON library, it uses std::strlen unincluded
#include <cudnn_frontend.h>

#include <algorithm>
#include <bit>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda/check.h"
#include "cuda/kernels.cuh"
#include "cuda/lru_cache.h"
#include "cuda/rank_state.h"

namespace zg::cuda {

namespace fe = cudnn_frontend;

// One rank's graphs (RankState::attention_graphs), keyed by everything a graph is built
// for (graph_key), each built or holding why it could not be. Each direction keeps at
// most kCapacity layouts, the least recently used going first (LruCache). Callers get
// entries by value -- the graph is shared -- so an eviction never pulls a graph from
// under a call that is executing it.
struct AttentionGraphs {
  struct Entry {
    std::shared_ptr<fe::graph::Graph> graph;
    int64_t workspace_bytes = 0;
    std::string unsupported;  // "" when built
  };
  static constexpr size_t kCapacity = 128;
  using Cache = LruCache<std::vector<int64_t>, Entry>;
  Cache forward{kCapacity}, backward{kCapacity};
};

namespace {

using Entry = AttentionGraphs::Entry;

// Which tensor of a graph each pointer of a variant pack is for.
enum Uid : int64_t { kQ = 1, kK, kV, kOut, kStats, kGradOut, kGradQ, kGradK, kGradV };

Entry declined(std::string why) {
  Entry entry;
  entry.unsupported = std::move(why);
  return entry;
}

// A 4-d operand as cuDNN is told it. A size-1 dim's stride addresses nothing; it is set
// to the operand's span (a multiple of 8 elements, like every stride flash_attention_unreadable
// checks in tensor/backend.cpp), so
// each stride cuDNN sees is positive and 16-byte aligned, and views that differ only
// there share a graph.
struct Layout {
  Shape dim, stride;
};

Layout layout(const Shape& dim, Shape stride) {
  int64_t span = 1;
  for (size_t d = 0; d < dim.size(); ++d)
    if (dim[d] > 1) span = std::max(span, dim[d] * stride[d]);
  for (size_t d = 0; d < dim.size(); ++d)
    if (dim[d] == 1) stride[d] = span;
  return {dim, std::move(stride)};
}

Layout layout_of(const Tensor& t) { return layout(t.shape(), t.strides()); }

// A fresh [B, H, T, D] operand as the front-end allocates it (autograd/functions/nn.cpp): a
// [B, T, H, D]-contiguous buffer seen through its transpose. The order is fixed, not
// read off `out`: layout() may have given out's size-1 dims any stride.
Layout bthd_packed(const Shape& dim) {
  const int64_t heads = dim[1], time = dim[2], head_size = dim[3];
  return layout(dim, {time * heads * head_size, head_size, heads * head_size, 1});
}

// The same for q, k, v packed as the thirds of one [B, T, 3, H, D] buffer (packed_qkv).
Layout bt3hd_packed(const Shape& dim) {
  const int64_t heads = dim[1], time = dim[2], head_size = dim[3];
  return layout(dim, {time * 3 * heads * head_size, head_size, 3 * heads * head_size, 1});
}

// One attention call as cuDNN sees it, and the layouts of its backward's other operands.
struct Problem {
  DType dtype;
  bool causal;
  double scale;
  Layout q, k, v;
  bool packed;  // q, k, v are packed (packed_qkv): so will dq, dk, dv be
};

struct BackwardLayouts {
  Layout out, grad_out, grad_q, grad_k, grad_v;
};

Problem problem(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale) {
  return {q.dtype(), causal, scale, layout_of(q), layout_of(k), layout_of(v), packed_qkv(q, k, v)};
}

// What the front-end (autograd/functions/nn.cpp) will hand attention_backward after a forward
// into `out`: out itself, grad_out fresh, and the gradients fresh or, for packed q, k, v,
// the thirds of one fresh packed buffer (Backend::attention_backward).
BackwardLayouts front_end_backward(const Problem& p, const Layout& out) {
  const auto fresh = p.packed ? bt3hd_packed : bthd_packed;
  return {out, bthd_packed(p.q.dim), fresh(p.q.dim), fresh(p.k.dim), fresh(p.v.dim)};
}

// Everything a graph is built for: dtype, mask, scale and its operands' layouts (the
// device is that of the rank state holding the cache).
std::vector<int64_t> graph_key(const Problem& p, std::initializer_list<const Layout*> layouts) {
  std::vector<int64_t> key{static_cast<int64_t>(p.dtype), p.causal ? 1 : 0, std::bit_cast<int64_t>(p.scale)};
  for (const Layout* l : layouts) {
    key.insert(key.end(), l->dim.begin(), l->dim.end());
    key.insert(key.end(), l->stride.begin(), l->stride.end());
  }
  return key;
}

// ---- the graphs ----

// bf16 or f16 in and out; scores, softmax and accumulators in fp32.
std::shared_ptr<fe::graph::Graph> new_graph(DType dtype) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(dtype == DType::bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return graph;
}

std::shared_ptr<fe::graph::Tensor_attributes> operand(fe::graph::Graph& graph, const char* name, Uid uid,
                                                      const Layout& l) {
  return graph.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(l.dim).set_stride(l.stride));
}

// The stats: [B, H, T, 1] fp32, contiguous.
fe::graph::Tensor_attributes& as_stats(fe::graph::Tensor_attributes& t, const Layout& q) {
  const int64_t batch = q.dim[0], heads = q.dim[1], time = q.dim[2];
  return t.set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim({batch, heads, time, 1})
      .set_stride({heads * time, time, 1, 1});
}

// Top-left causal mask: the band of allowed keys ends on the diagonal, j - i <= 0.
template <class Attributes>
void mask(Attributes& options, bool causal) {
  if (causal) options.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
}

// out, stats = SDPA(q, k, v), the training forward (it writes the stats).
std::shared_ptr<fe::graph::Graph> forward_graph(const Problem& p, const Layout& out) {
  auto graph = new_graph(p.dtype);
  auto options = fe::graph::SDPA_attributes()
                     .set_name("attention")
                     .set_generate_stats(true)
                     .set_attn_scale(static_cast<float>(p.scale))
                     .set_implementation(fe::AttentionImplementation_t::COMPOSITE);
  mask(options, p.causal);
  auto q = operand(*graph, "q", kQ, p.q), k = operand(*graph, "k", kK, p.k), v = operand(*graph, "v", kV, p.v);
  auto [o, stats] = graph->sdpa(q, k, v, options);
  o->set_output(true).set_uid(kOut).set_dim(out.dim).set_stride(out.stride);
  as_stats(stats->set_output(true), p.q);
  return graph;
}

// dq, dk, dv = the backward of SDPA at q, k, v, given out, stats and grad_out.
std::shared_ptr<fe::graph::Graph> backward_graph(const Problem& p, const BackwardLayouts& b) {
  auto graph = new_graph(p.dtype);
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("attention_backward")
                     .set_attn_scale(static_cast<float>(p.scale));
  mask(options, p.causal);
  auto q = operand(*graph, "q", kQ, p.q), k = operand(*graph, "k", kK, p.k), v = operand(*graph, "v", kV, p.v);
  auto o = operand(*graph, "out", kOut, b.out), grad_out = operand(*graph, "grad_out", kGradOut, b.grad_out);
  fe::graph::Tensor_attributes stats_attributes;
  auto stats = graph->tensor(as_stats(stats_attributes.set_name("stats"), p.q));
  auto [dq, dk, dv] = graph->sdpa_backward(q, k, v, o, grad_out, stats, options);
  dq->set_output(true).set_uid(kGradQ).set_dim(b.grad_q.dim).set_stride(b.grad_q.stride);
  dk->set_output(true).set_uid(kGradK).set_dim(b.grad_k.dim).set_stride(b.grad_k.stride);
  dv->set_output(true).set_uid(kGradV).set_dim(b.grad_v.dim).set_stride(b.grad_v.stride);
  return graph;
}

// A frontend call's status, an exception it throws turned into one.
template <class Call>
fe::error_t status_of(Call call) {
  try {
    return call();
  } catch (const std::exception& e) {
    return {fe::error_code_t::GRAPH_EXECUTION_FAILED, e.what()};
  }
}

// Builds a graph for the rank's handle: validates and lowers it, asks cuDNN's heuristics
// (mode A) for engine configurations, keeps those this GPU supports and compiles the
// first that builds.
fe::error_t build_graph(fe::graph::Graph& graph, cudnnHandle_t handle, int64_t& workspace_bytes) {
  if (fe::error_t status = graph.validate(); status.is_bad()) return status;
  if (fe::error_t status = graph.build_operation_graph(handle); status.is_bad()) return status;
  if (fe::error_t status = graph.create_execution_plans({fe::HeurMode_t::A}); status.is_bad()) return status;
  if (fe::error_t status = graph.check_support(); status.is_bad()) return status;
  if (fe::error_t status = graph.build_plans(); status.is_bad()) return status;
  return graph.get_workspace_size(workspace_bytes);
}

// Makes a graph and builds it; any failure leaves the entry saying why.
template <class Make>
Entry build(Make make, cudnnHandle_t handle, const char* which) {
  Entry entry;
  fe::error_t status = status_of([&] {
    entry.graph = make();
    return build_graph(*entry.graph, handle, entry.workspace_bytes);
  });
  if (status.is_good()) return entry;
  return declined(concat("cuDNN cannot build the attention ", which, " graph: ", status.get_message()));
}

// The entry for `key`, built by `make` the first time (the caller holds the rank's lock).
template <class Make>
Entry find_or_build(AttentionGraphs::Cache& cache, const std::vector<int64_t>& key, Make make,
                    cudnnHandle_t handle, const char* which) {
  return cache.get_or_make(key, [&] { return build(make, handle, which); });
}

// The rank's graphs on `device`, locked for the holder's scope, with the GPU current
// (cuDNN asks it for its architecture) and the rank's cuDNN handle.
struct RankGraphs {
  explicit RankGraphs(Device device)
      : guard(device.index), state(rank_state(device)), handle(state.cudnn()), lock(state.attention_mutex) {
    if (!state.attention_graphs) state.attention_graphs = std::make_shared<AttentionGraphs>();
  }
  AttentionGraphs& graphs() { return *state.attention_graphs; }

  DeviceGuard guard;
  RankState& state;
  cudnnHandle_t handle;
  std::lock_guard<std::mutex> lock;
};

Entry backward_entry(RankGraphs& rank, const Problem& p, const BackwardLayouts& b) {
  return find_or_build(rank.graphs().backward,
                       graph_key(p, {&p.q, &p.k, &p.v, &b.out, &b.grad_out, &b.grad_q, &b.grad_k, &b.grad_v}),
                       [&] { return backward_graph(p, b); }, rank.handle, "backward");
}

// The forward graph for p writing `out`, or why cuDNN cannot run it -- or, when
// `with_backward`, the backward the front-end will ask for after it.
Entry forward_graph_for(const Problem& p, const Layout& out, bool with_backward, Device device) {
  RankGraphs rank(device);
  const Entry forward = find_or_build(rank.graphs().forward, graph_key(p, {&p.q, &p.k, &p.v, &out}),
                                       [&] { return forward_graph(p, out); }, rank.handle, "forward");
  if (!forward.unsupported.empty() || !with_backward) return forward;
  const Entry backward = backward_entry(rank, p, front_end_backward(p, out));
  return backward.unsupported.empty() ? forward : declined(backward.unsupported);
}

Entry backward_graph_for(const Problem& p, const BackwardLayouts& b, Device device) {
  RankGraphs rank(device);
  return backward_entry(rank, p, b);
}

// The forward graph for a call, or why none takes it.
Entry forward_for(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, bool causal, double scale) {
  if (std::string why = flash_attention_unsupported(q, k, v, out); !why.empty()) return declined(std::move(why));
  // The front-end records a backward only when an input requires grad (autograd/graph.h).
  const bool with_backward = q.requires_grad() || k.requires_grad() || v.requires_grad();
  return forward_graph_for(problem(q, k, v, causal, scale), layout_of(out), with_backward, q.device());
}

// Queues a built graph on the rank's compute stream, its workspace from the caching
// allocator (stream-ordered: given back when we return, reused only by later work).
void execute(const Entry& built, std::unordered_map<int64_t, void*>& pack, const char* op, const Tensor& q,
             const Tensor& k) {
  OnDevice on(q.device());
  Tensor workspace;
  if (built.workspace_bytes > 0) {
    MemoryScope scope(MemoryCategory::workspace);
    workspace = Tensor::empty({built.workspace_bytes}, TensorOptions(DType::boolean).device(on.device));
  }
  const cudnnHandle_t handle = rank_state(on.device).cudnn();
  ZG_CUDNN_CHECK(cudnnSetStream(handle, on.stream));
  fe::error_t status = status_of(
      [&] { return built.graph->execute(handle, pack, workspace.defined() ? workspace.data_ptr() : nullptr); });
  ZG_CHECK(status.is_good(), op, ": cudnn_frontend::graph::Graph::execute failed for q ", describe(q), ", k ",
           describe(k), ": ", status.get_message());
}

}  // namespace

std::string fused_attention_unsupported(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                        bool causal, double scale) {
  return forward_for(q, k, v, out, causal, scale).unsupported;
}

AttentionGraphCount fused_attention_graphs(Device device) {
  RankGraphs rank(device);
  return {static_cast<int64_t>(rank.graphs().forward.size()),
          static_cast<int64_t>(rank.graphs().backward.size())};
}

bool CudaBackend::attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                            const Tensor& out, const Tensor& stats) {
  ZG_CHECK(out.shape() == q.shape() && out.dtype() == q.dtype() && out.device() == q.device() &&
               stats.shape() == Shape({q.size(0), q.size(1), q.size(2)}) && stats.dtype() == DType::f32 &&
               stats.is_contiguous() && stats.device() == q.device(),
           "attention: expected out laid out like q ", describe(q), " and contiguous f32 stats [B, H, T], got out ",
           describe(out), " and stats ", describe(stats));
  const Entry forward = forward_for(q, k, v, out, causal, scale);
  if (!forward.unsupported.empty()) return false;
  std::unordered_map<int64_t, void*> pack{{kQ, q.data_ptr()},     {kK, k.data_ptr()},         {kV, v.data_ptr()},
                                          {kOut, out.data_ptr()}, {kStats, stats.data_ptr()}};
  execute(forward, pack, "attention", q, k);
  return true;
}

void CudaBackend::attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                     const Tensor& stats, const Tensor& grad_out, bool causal, double scale,
                                     const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  const std::tuple<const Tensor*, const Tensor*, const char*> given[] = {
      {&grad_out, &out, "grad_out"}, {&dq, &q, "dq"}, {&dk, &k, "dk"}, {&dv, &v, "dv"}};
  for (const auto& [t, like, which] : given) {
    ZG_CHECK(t->shape() == like->shape() && t->dtype() == like->dtype() && t->device() == like->device(),
             "attention_backward: ", which, " ", describe(*t), " does not match ", describe(*like));
    const std::string why = flash_attention_unreadable(*t, which);
    ZG_CHECK(why.empty(), "attention_backward: ", why);
  }
  const Problem p = problem(q, k, v, causal, scale);
  const Entry backward = backward_graph_for(
      p, {layout_of(out), layout_of(grad_out), layout_of(dq), layout_of(dk), layout_of(dv)}, q.device());
  ZG_CHECK(backward.unsupported.empty(), "attention_backward: q ", describe(q), ", k ", describe(k), ": ",
           backward.unsupported);
  std::unordered_map<int64_t, void*> pack{
      {kQ, q.data_ptr()},     {kK, k.data_ptr()},          {kV, v.data_ptr()},           {kOut, out.data_ptr()},
      {kStats, stats.data_ptr()}, {kGradOut, grad_out.data_ptr()}, {kGradQ, dq.data_ptr()}, {kGradK, dk.data_ptr()},
      {kGradV, dv.data_ptr()}};
  execute(backward, pack, "attention_backward", q, k);
}

}  // namespace zg::cuda

#else  // built without the cuDNN frontend: no fused attention, the front-end composes it

namespace zg::cuda {

std::string fused_attention_unsupported(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool, double) {
  return "this build of zerograd has no cuDNN frontend (meson option cudnn-frontend; scripts/install-deps.sh "
         "installs it)";
}

AttentionGraphCount fused_attention_graphs(Device) { return {}; }

bool CudaBackend::attention(const Tensor&, const Tensor&, const Tensor&, bool, double, const Tensor&,
                            const Tensor&) {
  return false;
}

void CudaBackend::attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                     const Tensor& stats, const Tensor& grad_out, bool causal, double scale,
                                     const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  Backend::attention_backward(q, k, v, out, stats, grad_out, causal, scale, dq, dk, dv);
}

}  // namespace zg::cuda

#endif  // ZG_HAVE_CUDNN_FRONTEND
