// Tensor parallelism (dist/tensor/, dist/comm/differentiable.h): Megatron's layers, its
// vocabulary-parallel embedding and loss at T = 1, 2, 4 ranks against the one-rank ones
// from the same seed, and each differentiable collective's backward against its conjugate.
#include <functional>
#include <optional>

#include "helpers.h"

using namespace zg;
using test::check_close;
using test::Host;

namespace {

const TensorOptions kF64(DType::f64);
constexpr double kTol = 1e-12;

// sum(a * b) over every rank's a and b.
double dot_over_ranks(const Tensor& a, const Tensor& b, dist::ProcessGroup& group) {
  Tensor total = sum(a * b).reshape({1}).contiguous().clone();
  group.all_reduce(total);
  return total.item<double>();
}

// randn(shape) from `seed`: alike on every rank when the seed is.
Tensor randn_from(uint64_t seed, const Shape& shape) {
  manual_seed(seed);
  return randn(shape, kF64);
}

// The one-rank MLP and its tensor-parallel twin, from one seed, on the same x: the
// outputs, the input gradients and the gathered parameter gradients agree. `cut_between`:
// whether the activation between the layers stays cut (Megatron's MLP) or is gathered
// and cut again (gather_output, input_is_parallel false).
void check_mlp(dist::ProcessGroup& group, bool cut_between) {
  manual_seed(7);
  nn::Linear fc(8, 16, true, std::nullopt, kF64), proj(16, 6, true, std::nullopt, kF64);
  manual_seed(7);
  dist::ColumnParallelLinear column(8, 16, group, true, !cut_between, std::nullopt, kF64);
  dist::RowParallelLinear row(16, 6, group, true, cut_between, std::nullopt, kF64);
  CHECK(column.weight.shape() == Shape{16 / group.size(), 8});
  CHECK(row.weight.shape() == Shape{6, 16 / group.size()});
  test::check_identical(dist::all_gather_sequence(column.weight, group, 0), fc.weight, "the column slices are fc's");
  test::check_identical(dist::all_gather_sequence(row.weight, group, 1), proj.weight, "the row slices are proj's");

  const Tensor x = randn_from(8, {2, 3, 8}), w = randn_from(9, {2, 3, 6});  // alike on every rank
  Tensor x_one = x.clone(), x_tp = x.clone();
  x_one.set_requires_grad(true);
  x_tp.set_requires_grad(true);
  const Tensor y_one = proj(gelu(fc(x_one))), y_tp = row(gelu(column(x_tp)));
  sum(y_one * w).backward();
  sum(y_tp * w).backward();

  check_close(y_tp, Host::of(y_one), 0, kTol, "output");
  check_close(x_tp.grad(), Host::of(x_one.grad()), 0, kTol, "input gradient");
  check_close(dist::all_gather_sequence(column.weight.grad(), group, 0), Host::of(fc.weight.grad()), 0, kTol,
              "fc weight gradient");
  check_close(dist::all_gather_sequence(column.bias.grad(), group, 0), Host::of(fc.bias.grad()), 0, kTol,
              "fc bias gradient");
  check_close(dist::all_gather_sequence(row.weight.grad(), group, 1), Host::of(proj.weight.grad()), 0, kTol,
              "proj weight gradient");
  check_close(row.bias.grad(), Host::of(proj.bias.grad()), 0, kTol, "proj bias gradient");
}

// The one-rank embedding and its vocabulary-parallel twin from one seed: the same
// weights, outputs and (gathered) weight gradients, every id looked up, some twice.
void check_embedding(dist::ProcessGroup& group) {
  manual_seed(5);
  nn::Embedding one(8, 3, 0.02, kF64);
  manual_seed(5);
  dist::VocabParallelEmbedding tp(8, 3, group, 0.02, kF64);
  CHECK(tp.weight.shape() == Shape{8 / group.size(), 3});
  CHECK(tp.vocab_start == group.rank() * 8 / group.size());
  test::check_identical(dist::all_gather_sequence(tp.weight, group, 0), one.weight, "the row slices are one's");
  const Tensor tokens = tensor<int64_t>({0, 1, 2, 3, 4, 5, 6, 7, 7, 3}, {2, 5}, DType::i64);
  const Tensor y_one = one(tokens), y_tp = tp(tokens), w = randn_from(6, {2, 5, 3});
  sum(y_one * w).backward();
  sum(y_tp * w).backward();
  check_close(y_tp, Host::of(y_one), 0, kTol, "output");
  check_close(dist::all_gather_sequence(tp.weight.grad(), group, 0), Host::of(one.weight.grad()), 0, kTol,
              "weight gradient");
}

// cross_entropy of the full logits against vocab_parallel_cross_entropy of this rank's
// columns, each loss backpropagated into its own leaf.
struct BothLosses {
  Tensor x_one, x_tp, loss_one, loss_tp;
};
BothLosses both_losses(const Tensor& full, const Tensor& targets, dist::ProcessGroup& group) {
  const int64_t columns = full.size(1) / group.size();
  BothLosses b{full.clone(), full.narrow(1, group.rank() * columns, columns).clone(), Tensor(), Tensor()};
  b.x_one.set_requires_grad(true);
  b.x_tp.set_requires_grad(true);
  b.loss_one = cross_entropy(b.x_one, targets);
  b.loss_tp = dist::vocab_parallel_cross_entropy(b.x_tp, targets, group);
  b.loss_one.backward();
  b.loss_tp.backward();
  return b;
}

// The loss of logits [6, 8], and the gradient gathered along the vocabulary. At T = 4 the
// targets fall in every rank's range; the logits are large, so the max shift matters.
void check_cross_entropy(dist::ProcessGroup& group) {
  const Tensor targets = tensor<int64_t>({0, 7, 3, 4, 1, 6}, {6}, DType::i64);
  const BothLosses b = both_losses(randn_from(13, {6, 8}) * 30.0, targets, group);
  const Tensor &x_one = b.x_one, &x_tp = b.x_tp, &loss_one = b.loss_one, &loss_tp = b.loss_tp;
  CHECK(loss_tp.shape() == Shape{});
  check_close(loss_tp, Host::of(loss_one), 0, kTol, "loss");
  check_close(dist::all_gather_sequence(x_tp.grad(), group, 1), Host::of(x_one.grad()), 0, kTol, "gradient");
  // Through a retained graph twice: the saved softmax is kept for the second pass, not overwritten.
  x_tp.grad().zero_();
  const Tensor again = dist::vocab_parallel_cross_entropy(x_tp, targets, group);
  again.backward(Tensor(), /*retain_graph=*/true);
  again.backward();
  check_close(dist::all_gather_sequence(x_tp.grad(), group, 1), Host::of(x_one.grad() * 2.0), 0, kTol,
              "gradient of two passes");
}

// This rank's rows of x along the sequence dim, [.., S/T, ..].
Tensor rows_of(const Tensor& x, const dist::ProcessGroup& group, int64_t dim) {
  const int64_t n = x.size(dim) / group.size();
  return x.narrow(dim, group.rank() * n, n).contiguous();
}

// dropout(x) on one rank against sequence_parallel_dropout on this rank's rows of x,
// from one seed: the same values and input gradient, and the same number after it.
void check_dropout(dist::ProcessGroup& group, const Shape& shape, int64_t dim) {
  const Tensor x = randn_from(50, shape), w = randn_from(51, shape);
  Tensor x_one = x.clone(), x_sp = rows_of(x, group, dim);
  x_one.set_requires_grad(true);
  x_sp.set_requires_grad(true);
  manual_seed(52);
  const Tensor y_one = dropout(x_one, 0.4);
  const Tensor next_one = randn({5}, kF64);
  manual_seed(52);
  const Tensor y_sp = dist::sequence_parallel_dropout(x_sp, 0.4, true, group, dim);
  const Tensor next_sp = randn({5}, kF64);
  sum(y_one * w).backward();
  sum(y_sp * rows_of(w, group, dim)).backward();
  test::check_identical(y_sp.detach(), rows_of(y_one.detach(), group, dim), "output");
  test::check_identical(x_sp.grad(), rows_of(x_one.grad(), group, dim), "input gradient");
  test::check_identical(next_sp, next_one, "the next random op's numbers");
}

// A one-rank norm and its sequence-parallel twin, built alike, then given the same
// random parameters, on x [2, 8, 6] entered through scatter_to_sequence: this rank's rows
// of the output, and the one-rank gradients of x and of every parameter, on every rank.
void check_norm(dist::ProcessGroup& group, nn::Module& one, nn::Module& sp) {
  const nn::NamedTensors ones = one.named_parameters(), sps = sp.named_parameters();
  REQUIRE(ones.size() == sps.size());
  for (size_t i = 0; i < ones.size(); ++i) {
    CHECK(sps[i].first == ones[i].first);
    test::check_identical(sps[i].second, ones[i].second, ones[i].first + " as built");
    NoGradGuard no_grad;
    Tensor(ones[i].second).copy_(randn_from(60 + i, ones[i].second.shape()));
    Tensor(sps[i].second).copy_(ones[i].second);
  }
  const Tensor w = randn_from(54, {2, 8, 6});
  Tensor x_one = randn_from(53, {2, 8, 6}), x_sp = x_one.clone();
  x_one.set_requires_grad(true);
  x_sp.set_requires_grad(true);
  const Tensor y_one = one(x_one), y_sp = sp(dist::scatter_to_sequence(x_sp, group, 1));
  sum(y_one * w).backward();
  sum(y_sp * rows_of(w, group, 1)).backward();
  check_close(y_sp, Host::of(rows_of(y_one.detach(), group, 1)), 0, kTol, "output");
  check_close(x_sp.grad(), Host::of(x_one.grad()), 0, kTol, "input gradient (gathered by scatter_to_sequence)");
  for (size_t i = 0; i < ones.size(); ++i)
    check_close(sps[i].second.grad(), Host::of(ones[i].second.grad()), 0, kTol, ones[i].first + " gradient");
}

// A collective as a linear map A across the ranks, x -> A(x); `replicated_*`: every
// rank holds the same x (or the same cotangent), which then counts once, not T times.
struct CollectiveCase {
  const char* name;
  std::function<Tensor(const Tensor&, dist::ProcessGroup&)> apply;
  Shape input;  // each rank's x, its dim `cut` (if >= 0) times T
  int64_t cut;
  bool replicated_input, replicated_output;
  Shape input_shape(int world) const {
    Shape shape = input;
    if (cut >= 0) shape[cut] *= world;
    return shape;
  }
};

std::vector<CollectiveCase> collectives() {
  const auto gather_dim_1 = [](const Tensor& x, dist::ProcessGroup& g) { return dist::all_gather_sequence(x, g, 1); };
  const auto scatter_dim_0 = [](const Tensor& x, dist::ProcessGroup& g) { return dist::reduce_scatter_sequence(x, g); };
  const auto split_dim_1 = [](const Tensor& x, dist::ProcessGroup& g) { return dist::scatter_to_sequence(x, g, 1); };
  const auto join_dim_1 = [](const Tensor& x, dist::ProcessGroup& g) { return dist::gather_from_sequence(x, g, 1); };
  return {
      {"copy_to_group", dist::copy_to_group, {3, 4}, -1, true, false},
      {"reduce_from_group", dist::reduce_from_group, {3, 4}, -1, false, true},
      {"all_gather_sequence", gather_dim_1, {2, 3, 4}, -1, false, false},
      {"reduce_scatter_sequence", scatter_dim_0, {2, 3}, 0, false, false},
      {"gather_last_dim", dist::gather_last_dim, {3, 2}, -1, false, true},
      {"split_last_dim", dist::split_last_dim, {3, 2}, 1, true, false},
      {"scatter_to_sequence", split_dim_1, {2, 3, 4}, 1, true, false},
      {"gather_from_sequence", join_dim_1, {2, 3, 4}, -1, false, true},
  };
}

}  // namespace

TEST_CASE("ColumnParallelLinear -> gelu -> RowParallelLinear equals the one-rank MLP at T = 1, 2, 4 in f64") {
  for (int world : {1, 2, 4}) {
    for (bool cut_between : {true, false}) {
      INFO("T = " << world << ", activation cut between the layers: " << cut_between);
      dist::run_local(world, [&](dist::ProcessGroup& group) { check_mlp(group, cut_between); });
    }
  }
}

TEST_CASE("VocabParallelEmbedding equals the one-rank nn::Embedding at T = 1, 2, 4 in f64") {
  for (int world : {1, 2, 4}) {
    INFO("T = " << world);
    dist::run_local(world, check_embedding);
  }
}

TEST_CASE("vocab_parallel_cross_entropy equals cross_entropy of the full logits at T = 1, 2, 4 in f64") {
  for (int world : {1, 2, 4}) {
    INFO("T = " << world);
    dist::run_local(world, check_cross_entropy);
  }
}

TEST_CASE("vocab_parallel_cross_entropy never holds the full [N, V] logits on a rank") {
  // [N, V] in f64 is 2 MiB. The activations the call makes, forward and backward, peak at
  // one shard [N, V/T] (softmax, then the gradient written over it) and a dozen [N] vectors
  // (maxima, sums, the rows' weights in the mean);
  // the leaf's .grad, one more shard, is gradient memory.
  constexpr int64_t n = 64, vocab = 4096, full_bytes = n * vocab * 8;
  for (int world : {2, 4}) {
    INFO("T = " << world);
    dist::run_local(world, [&](dist::ProcessGroup& group) {
      const int64_t shard_bytes = full_bytes / group.size();
      Tensor x = randn_from(14 + group.rank(), {n, vocab / group.size()});
      x.set_requires_grad(true);
      manual_seed(15);
      const Tensor targets = randint(0, vocab, {n});  // alike on every rank
      Context::current().allocator(kCPU)->reset_peaks();
      const int64_t before = memory_stats().allocated_total;
      {
        MemoryScope activations(MemoryCategory::activation);
        dist::vocab_parallel_cross_entropy(x, targets, group).backward();
      }
      const MemoryStats stats = memory_stats();
      CHECK(stats.peak_of(MemoryCategory::activation) < shard_bytes + 96 * n);
      CHECK(stats.peak_total - before < 2 * shard_bytes + 96 * n);  // + the .grad
      CHECK(stats.peak_of(MemoryCategory::activation) < full_bytes);
    });
  }
}

// The dot-product test, a linear op's gradcheck: for random x and cotangent c,
// <A(x), c> = <x, A^T(c)> summed over the ranks, A^T(c) being what backward computes.
TEST_CASE("each differentiable collective's backward is the adjoint (conjugate) of its forward") {
  for (int world : {1, 2, 4}) {
    for (const CollectiveCase& op : collectives()) {
      INFO(op.name << " at T = " << world);
      dist::run_local(world, [&](dist::ProcessGroup& group) {
        const int T = group.size(), r = group.rank();
        Tensor x = randn_from(op.replicated_input ? 11 : 11 + r, op.input_shape(T));
        x.set_requires_grad(true);
        const Tensor y = op.apply(x, group);
        const Tensor c = randn_from(op.replicated_output ? 12 : 12 + r, y.shape());
        y.backward(c);
        const double forward = dot_over_ranks(y.detach(), c, group) / (op.replicated_output ? T : 1);
        const double backward = dot_over_ranks(x.detach(), x.grad(), group) / (op.replicated_input ? T : 1);
        CHECK(std::fabs(forward - backward) <= kTol * (1 + std::fabs(forward)));
      });
    }
  }
}

TEST_CASE("all_gather_sequence and reduce_scatter_sequence: the ranks' pieces in rank order, and back") {
  for (int world : {1, 2, 4}) {
    INFO("T = " << world);
    dist::run_local(world, [](dist::ProcessGroup& group) {
      const int T = group.size(), r = group.rank();
      std::vector<Tensor> pieces;  // every rank's x [2, 3, 4], known to every rank
      for (int q = 0; q < T; ++q) pieces.push_back(randn_from(20 + q, {2, 3, 4}));
      Tensor x = pieces[r].clone();
      x.set_requires_grad(true);
      const Tensor gathered = dist::all_gather_sequence(x, group, 1);
      test::check_identical(gathered.detach(), cat(pieces, 1), "gathered along dim 1");
      // Every rank gathered the same [2, 3T, 4]: the sum over ranks is T times it, this rank's slice T x.
      const Tensor back = dist::reduce_scatter_sequence(gathered, group, 1);
      check_close(back, Host::of(pieces[r] * double(T)), 0, kTol, "reduce-scattered back");
      // L = sum(back * w_r): backward all-gathers every rank's w, then reduce-scatters the
      // T ranks' copies of it, so dL/dx = T w_r.
      std::vector<Tensor> weights;
      for (int q = 0; q < T; ++q) weights.push_back(randn_from(40 + q, {2, 3, 4}));
      sum(back * weights[r]).backward();
      check_close(x.grad(), Host::of(weights[r] * double(T)), 0, kTol, "gradient");
    });
  }
}

TEST_CASE("the collectives' bytes are counted as the group counts every collective") {
  for (int world : {2, 4}) {
    INFO("T = " << world);
    dist::run_local(world, [](dist::ProcessGroup& group) {
      const double share = double(group.size() - 1) / group.size();  // a ring's (T-1)/T
      Tensor x = randn_from(30, {3, 4});                             // 96 bytes in f64
      x.set_requires_grad(true);
      group.reset_bytes_sent();
      const Tensor y = dist::copy_to_group(x, group);
      CHECK(group.bytes_sent() == 0);  // the identity forward moves nothing
      y.backward(randn_from(31, {3, 4}));
      CHECK(group.bytes_sent() == int64_t(2 * share * 96 + 0.5));  // the all-reduce backward: 2 (T-1)/T x bytes
      group.reset_bytes_sent();
      const Tensor gathered = dist::all_gather_sequence(x, group);
      CHECK(group.bytes_sent() == int64_t(share * 96 * group.size() + 0.5));  // (T-1)/T x the output's bytes
      gathered.backward(randn_from(32, gathered.shape()));
      CHECK(group.bytes_sent() == 2 * int64_t(share * 96 * group.size() + 0.5));  // + the reduce-scatter's input
    });
  }
}

TEST_CASE("a dim or a layer that does not divide by the group size is refused, naming it") {
  dist::run_local(4, [](dist::ProcessGroup& group) {
    const Tensor x = zeros({6, 4}, kF64);
    CHECK_THROWS_WITH_AS(dist::reduce_scatter_sequence(x, group),
                         "reduce_scatter_sequence: dim 0 of f64[6, 4] on cpu (6) does not divide by the group size 4",
                         Error);
    CHECK_THROWS_WITH_AS(dist::split_last_dim(zeros({4, 6}, kF64), group),
                         "split_last_dim: dim 1 of f64[4, 6] on cpu (6) does not divide by the group size 4", Error);
    CHECK_THROWS_WITH_AS(dist::all_gather_sequence(zeros({}, kF64), group), doctest::Contains("0-dim"), Error);
    CHECK_THROWS_WITH_AS(dist::ColumnParallelLinear(8, 6, group),
                         "ColumnParallelLinear: out_features 6 does not divide by the group size T = 4", Error);
    CHECK_THROWS_WITH_AS(dist::RowParallelLinear(6, 8, group),
                         "RowParallelLinear: in_features 6 does not divide by the group size T = 4", Error);
    CHECK_THROWS_WITH_AS(dist::VocabParallelEmbedding(10, 4, group),
                         "VocabParallelEmbedding: num_embeddings V = 10 does not divide by the group size T = 4",
                         Error);
    dist::RowParallelLinear row(8, 3, group, true, /*input_is_parallel=*/true, std::nullopt, kF64);
    CHECK_THROWS_WITH_AS(row(zeros({2, 8}, kF64)),
                         "RowParallelLinear: input f64[2, 8] on cpu does not end in 2 features (this rank's weight "
                         "f64[3, 2] on cpu)",
                         Error);
  });
}

TEST_CASE("vocab_parallel_cross_entropy refuses mismatched shapes, dtypes and ids outside the vocabulary") {
  dist::run_local(2, [](dist::ProcessGroup& group) {
    const Tensor logits = zeros({3, 4}, kF64), targets = zeros({3}, DType::i64);
    CHECK_THROWS_WITH_AS(dist::vocab_parallel_cross_entropy(logits, zeros({2}, DType::i64), group),
                         "vocab_parallel_cross_entropy: logits_shard [N, V/T] need targets [N], got f64[3, 4] on "
                         "cpu and i64[2] on cpu",
                         Error);
    CHECK_THROWS_WITH_AS(dist::vocab_parallel_cross_entropy(zeros({3}, kF64), targets, group),
                         doctest::Contains("need targets [N], got f64[3] on cpu"), Error);
    CHECK_THROWS_WITH_AS(dist::vocab_parallel_cross_entropy(logits, zeros({3}, kF64), group),
                         doctest::Contains("vocab_parallel_cross_entropy"), Error);
    CHECK_THROWS_WITH_AS(dist::vocab_parallel_cross_entropy(zeros({3, 4}, DType::i64), targets, group),
                         doctest::Contains("vocab_parallel_cross_entropy"), Error);
    CHECK_THROWS_WITH_AS(
        dist::vocab_parallel_cross_entropy(logits, tensor<int64_t>({0, 8, 1}, {3}, DType::i64), group),
        "vocab_parallel_cross_entropy: targets i64[3] on cpu must be ids in [0, V = 8), or -1 (ignored)", Error);
  });
}

TEST_CASE("the parallel linears' init_std draws nn::Linear's N(0, std) weights and zero biases") {
  dist::run_local(2, [](dist::ProcessGroup& group) {
    manual_seed(3);
    nn::Linear one(4, 6, true, 0.02, kF64);
    manual_seed(3);
    dist::ColumnParallelLinear column(4, 6, group, true, false, 0.02, kF64);
    manual_seed(3);
    dist::RowParallelLinear row(4, 6, group, true, true, 0.02, kF64);
    test::check_identical(dist::all_gather_sequence(column.weight, group, 0), one.weight, "column weight");
    test::check_identical(dist::all_gather_sequence(row.weight, group, 1), one.weight, "row weight");
    test::check_identical(column.bias, zeros({3}, kF64), "column bias");
    test::check_identical(row.bias, zeros({6}, kF64), "row bias");
  });
}

TEST_CASE("vocab_parallel_cross_entropy of bf16 logits: an f32 loss, as cross_entropy's, and a bf16 gradient") {
  dist::run_local(2, [](dist::ProcessGroup& group) {
    const Tensor targets = tensor<int64_t>({1, 6, 3, 4, 0}, {5}, DType::i64);
    const BothLosses b = both_losses((randn_from(16, {5, 8}) * 4.0).to(DType::bf16), targets, group);
    const Tensor &x_one = b.x_one, &x_tp = b.x_tp, &loss_one = b.loss_one, &loss_tp = b.loss_tp;
    CHECK(loss_tp.dtype() == DType::f32);
    CHECK(x_tp.grad().dtype() == DType::bf16);
    check_close(loss_tp, Host::of(loss_one), 1e-6, 1e-6, "loss");
    check_close(dist::all_gather_sequence(x_tp.grad(), group, 1), Host::of(x_one.grad()), 0, 1e-3, "gradient");
  });
}

TEST_CASE("sequence_parallel_dropout keeps exactly the one-rank mask's rows at T = 1, 2, 4, generator state included") {
  for (int world : {1, 2, 4}) {
    INFO("T = " << world);
    dist::run_local(world, [](dist::ProcessGroup& group) {
      check_dropout(group, {2, 8, 3}, 1);  // [B, S, C]: B runs per rank, most starting inside a Philox block
      check_dropout(group, {8, 2, 3}, 0);  // Megatron's [S, B, C]: one run per rank
      check_dropout(group, {2, 3, 8}, -1);
    });
  }
}

TEST_CASE("SequenceParallelDropout: dropout's mask rows in training, the identity in eval, shapes on the meta device") {
  dist::run_local(2, [](dist::ProcessGroup& group) {
    dist::SequenceParallelDropout drop(0.5, group, 1);
    const Tensor x = randn_from(55, {2, 4, 3});
    manual_seed(56);
    const Tensor one = dropout(x, 0.5);
    manual_seed(56);
    test::check_identical(drop(rows_of(x, group, 1)), rows_of(one, group, 1), "training");
    drop.eval();
    test::check_identical(drop(rows_of(x, group, 1)), rows_of(x, group, 1), "eval");
    const Tensor meta = dist::sequence_parallel_dropout(empty({2, 4, 3}, TensorOptions(DType::bf16).device(kMeta)),
                                                        0.5, true, group, 1);
    CHECK(meta.shape() == Shape{2, 4, 3});
    CHECK(meta.dtype() == DType::bf16);
  });
}

TEST_CASE("SequenceParallelLayerNorm and SequenceParallelRMSNorm equal the one-rank norms at T = 1, 2, 4 in f64") {
  for (int world : {1, 2, 4}) {
    INFO("T = " << world);
    dist::run_local(world, [](dist::ProcessGroup& group) {
      nn::LayerNorm layer_norm(6, 1e-5, true, kF64);
      dist::SequenceParallelLayerNorm sp_layer_norm(6, group, 1e-5, true, kF64);
      check_norm(group, layer_norm, sp_layer_norm);
      nn::RMSNorm rms_norm(6, 1e-6, kF64);
      dist::SequenceParallelRMSNorm sp_rms_norm(6, group, 1e-6, kF64);
      check_norm(group, rms_norm, sp_rms_norm);
    });
  }
}

TEST_CASE("sequence parallelism refuses a sequence that does not divide by T, and p outside [0, 1]") {
  dist::run_local(4, [](dist::ProcessGroup& group) {
    CHECK_THROWS_WITH_AS(dist::scatter_to_sequence(zeros({2, 6, 3}, kF64), group, 1),
                         "scatter_to_sequence: dim 1 of f64[2, 6, 3] on cpu (6) does not divide by the group size 4",
                         Error);
    const Tensor x = zeros({2, 2, 3}, kF64);
    CHECK_THROWS_WITH_AS(dist::sequence_parallel_dropout(x, 1.5, true, group, 1),
                         "sequence_parallel_dropout: p must be in [0, 1], got 1.5", Error);
    CHECK_THROWS_WITH_AS(dist::sequence_parallel_dropout(x, -0.1, false, group, 1),
                         "sequence_parallel_dropout: p must be in [0, 1], got -0.1", Error);
    CHECK_THROWS_WITH_AS(dist::sequence_parallel_dropout(x, 0.5, true, group, 3), doctest::Contains("dim"), Error);
    CHECK_THROWS_WITH_AS(dist::sequence_parallel_dropout(zeros({2}, DType::i64), 0.5, true, group),
                         "sequence_parallel_dropout: expected a floating tensor, got i64[2] on cpu", Error);
    CHECK_THROWS_WITH_AS(dist::SequenceParallelDropout(2.0, group), "Dropout: p must be in [0, 1], got 2", Error);
  });
}

TEST_CASE("slice_of a deferred tensor: still deferred, materialised to the eager slice's values, any dim and chunks") {
  for (const Shape& shape : {Shape{12, 8}, Shape{4, 6, 8}})
    for (int64_t dim = 0; dim < static_cast<int64_t>(shape.size()); ++dim)
      for (int64_t chunks : {1, 3})
        for (int part : {0, 1}) {
          if (shape[dim] % (chunks * 2) != 0) continue;
          INFO("shape " << shape_str(shape) << ", dim " << dim << ", " << chunks << " chunk(s), part " << part);
          const nn::TensorSplit split{dim, chunks, 2, part};
          const Tensor eager = dist::slice_of(randn_from(7, shape).to(DType::bf16), split);
          manual_seed(7);
          Tensor deferred;
          {
            DeferredInit deferring;
            deferred = deferred_to(randn(shape, kF64), TensorOptions(DType::bf16));  // drawn in f64, rounded once
          }
          const Tensor slice = dist::slice_of(deferred, split);
          REQUIRE(is_deferred(slice));
          CHECK(slice.shape() == eager.shape());
          CHECK(max(abs(materialize(slice).to(DType::f64) - eager.to(DType::f64))).item<double>() == 0);
          const Tensor middle = empty({5}, TensorOptions(DType::f32));  // a range, widened to f32
          materialize_range(slice, 3, middle);
          CHECK(max(abs(middle.to(DType::f64) - eager.reshape({-1}).narrow(0, 3, 5).to(DType::f64))).item<double>() ==
                0);
          CHECK_THROWS_WITH_AS(dist::slice_of(slice, {0, 1, 2, 0}), doctest::Contains("is a slice already"), Error);
        }
}
