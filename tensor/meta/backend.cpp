// The meta backend: tensors with shapes, dtypes and counted bytes but no data.
// Allocations are accounted exactly (so a memory plan for a 7.5B-parameter model
// can be read on a laptop) and every kernel does nothing. Where the CPU and a GPU
// differ in what they keep (fused attention), it does what a GPU does. Under a
// StepLogScope each kernel notes its work: the FLOPs of its matrix products and the
// bytes it reads and writes (tensor/step_log.h), what a step-time model replays.
#include <initializer_list>

#include "tensor/backend.h"
#include "tensor/step_log.h"

namespace zg {

namespace {

class MetaAllocator final : public Allocator {
 public:
  MetaAllocator() : Allocator(kMeta) {}

 private:
  void* acquire(int64_t bytes, MemoryCategory category) override {
    if (!fits_cap(bytes)) throw_out_of_memory(bytes, category, "over the memory cap");
    add_reserved(bytes);
    return nullptr;
  }
  void release(void*, int64_t bytes) override { add_reserved(-bytes); }
};

// A kernel's work, noted in the thread's step log if one records: `flops`, and the bytes
// of the tensors it reads and writes (each once, as a fused kernel moves them). On the
// host pool's tensors it is the host's work (offload's CPU AdamW); the device's tensors of
// a kernel that mixes the two cross the host link first (a gradient shard going down).
void note(double flops, std::initializer_list<const Tensor*> tensors) {
  StepLog* log = StepLog::current();
  if (log == nullptr) return;
  double bytes = 0, host_bytes = 0;
  for (const Tensor* t : tensors) {
    if (!t->defined()) continue;
    bytes += static_cast<double>(t->nbytes());
    if (t->storage()->allocator()->host_pool()) host_bytes += static_cast<double>(t->nbytes());
  }
  if (host_bytes == 0) return log->compute(flops, bytes);
  if (host_bytes < bytes) log->offload(StepEvent::Kind::link, bytes - host_bytes);
  log->offload(StepEvent::Kind::host, host_bytes);
}

// Attention's forward FLOPs: Q K^T and P V, 2 x 2 B H Tq Tk D, half of them for a causal mask.
double attention_flops(const Tensor& q, const Tensor& k, bool causal) {
  const double tk = static_cast<double>(k.size(k.dim() - 2));
  return 4.0 * static_cast<double>(q.numel()) * tk * (causal ? 0.5 : 1.0);
}

class MetaBackend final : public Backend {
 public:
  std::shared_ptr<Allocator> make_allocator(Device) override { return std::make_shared<MetaAllocator>(); }
  void fill(const Tensor& out, double) override { note(0, {&out}); }
  void fill_random(const Tensor& out, const RandomSpec&) override { note(0, {&out}); }
  void copy(const Tensor& src, const Tensor& dst) override { note(0, {&src, &dst}); }
  void unary(UnaryOp, const Tensor& in, const Tensor& out) override { note(0, {&in, &out}); }
  void binary(BinaryOp, const Tensor& a, const Tensor& b, const Tensor& out) override { note(0, {&a, &b, &out}); }
  void where(const Tensor& c, const Tensor& a, const Tensor& b, const Tensor& out) override { note(0, {&c, &a, &b, &out}); }
  void reduce(ReduceOp, const Tensor& in, const Tensor& out) override { note(0, {&in, &out}); }
  // out [..., M, N] = a [..., M, K] b [..., K, N]: 2 M N K a batch entry.
  void matmul(const Tensor& a, const Tensor& b, const Tensor& out) override {
    note(2.0 * static_cast<double>(out.numel()) * static_cast<double>(a.size(a.dim() - 1)), {&a, &b, &out});
  }
  void softmax(const Tensor& in, bool, const Tensor& out) override { note(0, {&in, &out}); }
  void layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double, const Tensor& out, const Tensor&,
                  const Tensor&) override {
    note(0, {&x, &w, &b, &out});
  }
  void layer_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& w, const Tensor&, const Tensor&,
                           const Tensor& grad_x, const Tensor& grad_w, const Tensor& grad_b) override {
    note(0, {&grad, &x, &w, &grad_x, &grad_w, &grad_b});
  }
  void embedding(const Tensor&, const Tensor& indices, const Tensor& out) override { note(0, {&indices, &out, &out}); }
  void embedding_backward(const Tensor& grad, const Tensor& indices, const Tensor& grad_weight) override {
    note(0, {&grad, &indices, &grad_weight});
  }
  void sort_rows(const Tensor& in, bool, const Tensor& indices) override { note(0, {&in, &indices}); }
  void quantize_blocks(const Tensor& in, int, int64_t, int64_t, const Tensor& q, const Tensor& scales) override {
    note(0, {&in, &q, &scales});
  }
  void dequantize_blocks(const Tensor& q, const Tensor& scales, int, int64_t, int64_t, const Tensor& out) override {
    note(0, {&q, &scales, &out});
  }
  void cumsum_rows(const Tensor& in, const Tensor& out) override { note(0, {&in, &out}); }

  void adamw(const Tensor& master, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& out,
             const AdamWStep&) override {
    // Master, m, v read and written. Offloaded (the master in the host pool), that is the
    // CPU's work, and 16-bit weights it writes on the device cross the host link (a dry
    // run's device and host are both meta; a GPU run writes a host buffer and copies it up).
    StepLog* log = StepLog::current();
    if (log == nullptr || !master.storage()->allocator()->host_pool()) {
      note(0, {&master, &master, &grad, &m, &m, &v, &v, &out});
      return;
    }
    const bool up = out.defined() && !out.storage()->allocator()->host_pool();
    double bytes = 0;
    for (const Tensor* t : {&master, &master, &grad, &m, &m, &v, &v, &out})
      bytes += t->defined() ? static_cast<double>(t->nbytes()) : 0;
    log->offload(StepEvent::Kind::host, bytes - (up ? static_cast<double>(out.nbytes()) : 0));
    if (up) log->offload(StepEvent::Kind::link, static_cast<double>(out.nbytes()));
  }
  void cross_entropy(const Tensor& logits, const Tensor& target, int64_t, const Tensor& out) override {
    note(0, {&logits, &target, &out});
  }
  void cross_entropy_backward(const Tensor& logits, const Tensor& target, int64_t, const Tensor& loss,
                              const Tensor&, const Tensor& grad_logits) override {
    note(0, {&logits, &target, &loss, &grad_logits});
  }
  // Fused where a GPU's would be: a dry run stands for a GPU run, which keeps attention's
  // row statistics for backward rather than its probabilities.
  bool attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double, const Tensor& out,
                 const Tensor&) override {
    const bool fused = flash_attention_unsupported(q, k, v, out).empty();
    if (fused) note(attention_flops(q, k, causal), {&q, &k, &v, &out});
    return fused;
  }
  // FlashAttention's backward: the forward's two products recomputed, three more: 2.5 x its FLOPs.
  void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor&,
                          const Tensor& grad_out, bool causal, double, const Tensor& grad_q, const Tensor& grad_k,
                          const Tensor& grad_v) override {
    note(2.5 * attention_flops(q, k, causal), {&q, &k, &v, &out, &grad_out, &grad_q, &grad_k, &grad_v});
  }
};

}  // namespace

Backend& meta_backend() {
  static MetaBackend backend;
  return backend;
}

}  // namespace zg
