// The meta backend: tensors with shapes, dtypes and counted bytes but no data.
// Allocations are accounted exactly (so a memory plan for a 7.5B-parameter model
// can be read on a laptop) and every kernel does nothing. Where the CPU and a GPU
// differ in what they keep (fused attention), it does what a GPU does.
#include "tensor/backend.h"

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

class MetaBackend final : public Backend {
 public:
  std::shared_ptr<Allocator> make_allocator(Device) override { return std::make_shared<MetaAllocator>(); }
  void fill(const Tensor&, double) override {}
  void fill_random(const Tensor&, const RandomSpec&) override {}
  void copy(const Tensor&, const Tensor&) override {}
  void unary(UnaryOp, const Tensor&, const Tensor&) override {}
  void binary(BinaryOp, const Tensor&, const Tensor&, const Tensor&) override {}
  void where(const Tensor&, const Tensor&, const Tensor&, const Tensor&) override {}
  void reduce(ReduceOp, const Tensor&, const Tensor&) override {}
  void matmul(const Tensor&, const Tensor&, const Tensor&) override {}
  void softmax(const Tensor&, bool, const Tensor&) override {}
  void layer_norm(const Tensor&, const Tensor&, const Tensor&, double, const Tensor&, const Tensor&,
                  const Tensor&) override {}
  void layer_norm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                           const Tensor&, const Tensor&) override {}
  void embedding(const Tensor&, const Tensor&, const Tensor&) override {}
  void embedding_backward(const Tensor&, const Tensor&, const Tensor&) override {}
  void adamw(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const AdamWStep&) override {}
  void cross_entropy(const Tensor&, const Tensor&, int64_t, const Tensor&) override {}
  void cross_entropy_backward(const Tensor&, const Tensor&, int64_t, const Tensor&, const Tensor&,
                              const Tensor&) override {}
  // Fused where a GPU's would be: a dry run stands for a GPU run, which keeps attention's
  // row statistics for backward rather than its probabilities.
  bool attention(const Tensor& q, const Tensor& k, const Tensor& v, bool, double, const Tensor& out,
                 const Tensor&) override {
    return flash_attention_unsupported(q, k, v, out).empty();
  }
  void attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          bool, double, const Tensor&, const Tensor&, const Tensor&) override {}
};

}  // namespace

Backend& meta_backend() {
  static MetaBackend backend;
  return backend;
}

}  // namespace zg
