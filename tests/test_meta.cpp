// Meta tensors: shapes and counted bytes with no storage behind them, so a
// memory plan for a model far larger than the machine can be computed.
#include "helpers.h"
#include "nn/gpt.h"
#include "tensor/backend.h"

namespace zg::test {

TEST_CASE("meta ops produce the right shapes and no data") {
  Context rank;
  ContextGuard guard(rank);
  const TensorOptions meta = TensorOptions(DType::bf16).device(kMeta);
  const Tensor x = randn({8, 1024, 4096}, meta);
  const Tensor w = empty({4096, 16384}, meta);
  CHECK(x.data_ptr() == nullptr);
  const Tensor h = gelu(matmul(x, w));
  CHECK(h.shape() == Shape{8, 1024, 16384});
  CHECK(h.device() == kMeta);
  CHECK(h.dtype() == DType::bf16);
  CHECK(sum(h, {1}, true).shape() == Shape{8, 1, 16384});
  CHECK(argmax(h, -1).dtype() == DType::i64);
  CHECK(softmax(h, 1).shape() == h.shape());
  CHECK(layer_norm(x, empty({4096}, meta), Tensor()).shape() == x.shape());
  const Tensor ids = zeros({8, 1024}, TensorOptions(DType::i64).device(kMeta));
  CHECK(embedding(w.t(), ids).shape() == Shape{8, 1024, 4096});
  CHECK(cross_entropy(h, ids).shape() == Shape{});
  CHECK(cat({x, x}, 2).shape() == Shape{8, 1024, 8192});
  CHECK(zeros({2, 3}).to(kMeta).device() == kMeta);
  CHECK(x.to(DType::f32).dtype() == DType::f32);
}

TEST_CASE("issue 43's ops give their shapes and dtypes on meta") {
  const TensorOptions meta = TensorOptions(DType::bf16).device(kMeta);
  const Tensor x = empty({4, 6, 8}, meta);
  CHECK(cumsum(x, 1).shape() == x.shape());
  CHECK(cumsum(empty({4, 6}, TensorOptions(DType::i32).device(kMeta)), 0).dtype() == DType::i64);
  CHECK(log1p(x).shape() == x.shape());
  CHECK(flip(x, {0, 2}).shape() == x.shape());
  CHECK(repeat(x, {2, 1, 1, 3}).shape() == Shape{2, 4, 6, 24});
  CHECK(chunk(x, 4, 2).size() == 4);
  CHECK(unbind(x, 0).size() == 4);
  CHECK(pad(x, {1, 2, 3, 4}).shape() == Shape{4, 13, 11});
  CHECK(pad(x, {1, 2}, PadMode::reflect).shape() == Shape{4, 6, 11});
  CHECK(norm(x, 2, {-1}).shape() == Shape{4, 6});
  CHECK(normalize(x, 2, -1).shape() == x.shape());
  CHECK(softplus(x).dtype() == DType::bf16);
  CHECK(leaky_relu(x).shape() == x.shape());
  CHECK(isnan(x).dtype() == DType::boolean);
  CHECK(isinf(x).shape() == x.shape());
  CHECK(any(x, {1}).shape() == Shape{4, 8});
  CHECK(all(x).dtype() == DType::boolean);
  CHECK(einsum("bij,bkj->bik", {x, empty({4, 5, 8}, meta)}).shape() == Shape{4, 6, 5});
  CHECK(eye(3, 5, meta).shape() == Shape{3, 5});
  CHECK(linspace(0, 1, 9, meta).shape() == Shape{9});
  CHECK(randn_like(x).device() == kMeta);
}

TEST_CASE("meta allocations are counted exactly without being backed") {
  Context rank;
  ContextGuard guard(rank);
  {
    MemoryScope scope(MemoryCategory::parameter);
    // 7.5B parameters in f32 would be 30 GB: counted, never allocated.
    const Tensor params = empty({7'500'000'000}, TensorOptions(DType::f32).device(kMeta));
    const MemoryStats s = memory_stats(kMeta);
    CHECK(s[MemoryCategory::parameter] == 30'000'000'000);
    CHECK(s.reserved == 30'000'000'000);
    CHECK(memory_stats(kCPU).allocated_total == 0);
  }
  CHECK(memory_stats(kMeta)[MemoryCategory::parameter] == 0);
  CHECK(memory_stats(kMeta).peak_of(MemoryCategory::parameter) == 30'000'000'000);

  // Counts that would overflow int64 are out of memory, not negative figures (found by fuzzing).
  const TensorOptions meta = TensorOptions(DType::f32).device(kMeta);
  const Tensor huge = empty({int64_t{1} << 58}, meta);  // 2^60 bytes: counted
  CHECK_THROWS_WITH_AS(empty({int64_t{1} << 59}, meta), doctest::Contains("more than 2^61 bytes in all"), OutOfMemory);
  CHECK(memory_stats(kMeta).allocated_total == int64_t{1} << 60);
  CHECK(memory_stats(kMeta).peak_total >= int64_t{1} << 60);
}

TEST_CASE("meta tensors have no data to read") {
  const Tensor m = zeros({2, 3}, kMeta);
  CHECK_THROWS_WITH_AS(m.to(kCPU), "copy_: cannot copy data out of a meta tensor (f32[2, 3] on meta); meta tensors have shapes but no data", Error);
  CHECK_THROWS_WITH_AS(m.to_vector<float>(), "to_vector: cannot read data of a meta tensor (f32[2, 3] on meta); meta "
                       "tensors have shapes but no data", Error);
  CHECK_THROWS_WITH_AS(sum(m).item<float>(), "item: cannot read data of a meta tensor (f32[] on meta); meta tensors "
                       "have shapes but no data", Error);
  CHECK(m.str() == "tensor(..., device='meta', size=(2, 3))");
}

TEST_CASE("meta attention keeps what a GPU's flash attention keeps: row statistics, not probabilities") {
  // A dry run stands for a GPU run. Composed from matmul and softmax, as on the CPU, it
  // counted the [B, H, T, T] probabilities of every layer: GPT-2 124M at batch 16 showed
  // 13.2 GB of activations, where a GPU with cuDNN keeps 6.6.
  for (const DType dtype : {DType::bf16, DType::f32}) {  // f32: no flash kernel takes it
    INFO(std::string(name(dtype)));
    Context rank;
    ContextGuard guard(rank);
    const TensorOptions meta = TensorOptions(dtype).device(kMeta);
    const Tensor q = randn({2, 4, 256, 64}, meta).set_requires_grad(true), k = randn({2, 4, 256, 64}, meta),
                 v = randn({2, 4, 256, 64}, meta);
    const int64_t before = memory_stats(kMeta).allocated_total;
    const Tensor out = scaled_dot_product_attention(q, k, v, true);
    const int64_t kept = memory_stats(kMeta).allocated_total - before;
    const int64_t probabilities = 2 * 4 * 256 * 256 * element_size(dtype);
    if (dtype == DType::bf16) CHECK(kept == out.nbytes() + 2 * 4 * 256 * 4);  // out and f32 statistics
    else CHECK(kept >= probabilities);
    sum(out).backward();
    CHECK(q.grad().shape() == q.shape());
  }
  // A view that starts off a 16-byte boundary is refused on meta as cuDNN refuses it.
  const TensorOptions meta = TensorOptions(DType::bf16).device(kMeta);
  const int64_t n = 2 * 4 * 16 * 64;
  const Tensor aligned = empty({2, 4, 16, 64}, meta), shifted = empty({n + 1}, meta).narrow(0, 1, n).view({2, 4, 16, 64});
  CHECK(flash_attention_unsupported(aligned, aligned, aligned, aligned).empty());
  CHECK_FALSE(flash_attention_unsupported(shifted, aligned, aligned, aligned).empty());
}

TEST_CASE("flash attention over packed q, k, v writes their gradient straight into one packed buffer") {
  // As llm.c does: cuDNN writes dq, dk, dv into the thirds of the projection's [B, T, 3C]
  // gradient. They came in three fresh buffers, copied into a fourth.
  Context rank;
  ContextGuard guard(rank);
  const int64_t batch = 2, time = 256, heads = 4, head = 64, channels = heads * head;
  const Tensor qkv = randn({batch, time, 3 * channels}, TensorOptions(DType::bf16).device(kMeta)).set_requires_grad(true);
  const Tensor y = packed_attention(qkv, heads, true);
  const Tensor g = ones_like(y);
  Context::current().allocator(kMeta)->reset_peaks();
  const int64_t before = memory_stats(kMeta).allocated_total;
  int64_t peak_in_backward = -1;  // when the gradient reaches the leaf (which then copies it into .grad)
  qkv.register_hook([&](const Tensor& grad) {
    CHECK(grad.shape() == qkv.shape());
    peak_in_backward = memory_stats(kMeta).peak_total - before;
    return Tensor();
  });
  y.backward(g);
  CHECK(peak_in_backward == qkv.nbytes());  // the gradient itself, nothing beside it
  // The rule the front-end and the CUDA backend share: the thirds of one [B, T, 3C] buffer.
  const auto thirds = [&](const Tensor& t) {
    std::vector<Tensor> parts;
    for (int64_t i = 0; i < 3; ++i)
      parts.push_back(t.narrow(2, i * channels, channels).view({batch, time, heads, head}).transpose(1, 2));
    return parts;
  };
  const std::vector<Tensor> p = thirds(qkv.detach()), other = thirds(randn(qkv.shape(), TensorOptions(DType::bf16).device(kMeta)));
  CHECK(packed_qkv(p[0], p[1], p[2]));
  CHECK_FALSE(packed_qkv(p[1], p[0], p[2]));      // out of order
  CHECK_FALSE(packed_qkv(p[0], p[1], other[2]));  // another buffer
  const Tensor fresh = empty({batch, time, heads, head}, TensorOptions(DType::bf16).device(kMeta)).transpose(1, 2);
  CHECK_FALSE(packed_qkv(fresh, fresh, fresh));
}

TEST_CASE("a GPT step on meta whose caller keeps only the loss needs no second buffer for the logits' gradient") {
  // cross_entropy's backward writes the gradient over the logits once nothing else holds
  // them; an output held through backward keeps them, and backward allocates its own.
  nn::GPTConfig config;
  config.n_layer = 1, config.n_head = 2, config.n_embd = 64, config.vocab_size = 4096, config.block_size = 128;
  const int64_t logits_bytes = 4 * 128 * config.vocab_size * 2;  // bf16 [4, 128, vocab]
  std::vector<int64_t> peaks;
  for (const bool keep_output : {false, true}) {
    Context rank;
    ContextGuard guard(rank);
    nn::GPT model(config, TensorOptions(DType::bf16).device(kMeta));
    for (auto& [name, p] : model.named_parameters()) p.set_requires_grad(true);
    const Tensor ids = zeros({4, 128}, TensorOptions(DType::i64).device(kMeta));
    Context::current().allocator(kMeta)->reset_peaks();
    nn::GPTOutput out = model.forward(ids, ids);
    const Tensor loss = out.loss;
    if (!keep_output) out = {};
    loss.backward();
    peaks.push_back(memory_stats(kMeta).peak_total);
  }
  CHECK(peaks[1] - peaks[0] >= logits_bytes);
}

}  // namespace zg::test
