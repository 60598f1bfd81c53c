#include "dist/tensor/vocab_parallel.h"

#include "autograd/functions.h"
#include "autograd/record.h"
#include "dist/comm/differentiable.h"
#include "dist/tensor/parallelize.h"
#include "nn/layers.h"
#include "tensor/backend.h"
#include "tensor/checks.h"

namespace zg::dist {

namespace {

const DifferentiableOp kVocabParallelCrossEntropy("vocab_parallel_cross_entropy");

// This rank's rows of the weight nn::Embedding(V, dim) draws from the current generator:
// the full table is built, then narrowed and cloned (as parallel_linear's slices), so the
// T slices are exactly the one-rank draws, at the price of the full table's memory while
// the constructor runs.
Tensor slice_of_embedding(int64_t num_embeddings, int64_t dim, const ProcessGroup& group, double init_std,
                          TensorOptions options) {
  ZG_CHECK(num_embeddings % group.size() == 0, "VocabParallelEmbedding: num_embeddings V = ", num_embeddings,
           " does not divide by the group size T = ", group.size());
  NoGradGuard no_grad;
  nn::Embedding full(num_embeddings, dim, init_std, options);
  return slice_of(full.weight, {0, 1, group.size(), group.rank()});
}

// vocab_parallel_cross_entropy's backward, with no communication:
//   dx_i = (softmax(x_i) - onehot(target_i)) g w_i   on this rank's columns (w_i: row i's share of the mean),
// written over the saved softmax when nothing else reads it (cross_entropy's way), so
// backward makes no second shard; a retained graph keeps it for the next pass.
struct SoftmaxMinusOnehot {
  SavedTensor probs;  // [N, V/T]
  Tensor positions;   // i64 [N]: each row's target in probs viewed as [N V/T, 1]
  Tensor owned;       // [N, 1]: 1 where this rank holds the row's target, else 0
  Tensor row_scale;   // [N, 1]: w_i = 1 / (rows not ignored), 0 for an ignored row
  DType dtype;  // the logits'

  std::vector<Tensor> operator()(const Tensor& g) const {
    constexpr const char* op = "vocab_parallel_cross_entropy";
    const Tensor reusable = probs.get_for_overwrite(op);
    const Tensor dx = reusable.defined() ? reusable : probs.get(op).clone();
    const Tensor scale = g * row_scale;
    Backend& kernels = backend(dx.device());
    kernels.binary(BinaryOp::mul, dx, scale.expand(dx.shape()), dx);
    kernels.embedding_backward((owned * -scale).contiguous(), positions, dx.view({dx.numel(), 1}));
    return {dx.to(dtype)};
  }
};

}  // namespace

VocabParallelEmbedding::VocabParallelEmbedding(int64_t num_embeddings, int64_t embedding_dim, ProcessGroup& group,
                                               double init_std, TensorOptions options)
    : group_(group, "VocabParallelEmbedding: its process group was destroyed; keep the group as long as the layer") {
  weight = register_parameter("weight", slice_of_embedding(num_embeddings, embedding_dim, group, init_std, options));
  vocab_start = group.rank() * weight.size(0);
}

Tensor VocabParallelEmbedding::forward(const Tensor& tokens) {
  detail::check_index_dtype("VocabParallelEmbedding", tokens);
  // This rank's rows for its tokens, zeros for the others; the sum over ranks has every row once.
  return reduce_from_group(nn::embedding_rows(weight, tokens, vocab_start), *group_);
}

Tensor vocab_parallel_cross_entropy(const Tensor& logits_shard, const Tensor& targets, ProcessGroup& group) {
  constexpr const char* op = "vocab_parallel_cross_entropy";
  detail::check_floating(op, logits_shard);
  detail::check_index_dtype(op, targets);
  ZG_CHECK(logits_shard.device() == targets.device(), op, ": device mismatch: ", describe(logits_shard), " and ",
           describe(targets));
  ZG_CHECK(logits_shard.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits_shard.size(0), op,
           ": logits_shard [N, V/T] need targets [N], got ", describe(logits_shard), " and ", describe(targets));
  const int64_t n = logits_shard.size(0), columns = logits_shard.size(1), vocab = columns * group.size();
  ZG_CHECK(n > 0 && columns > 0, op, ": nothing to average over in ", describe(logits_shard));
  // An id no rank holds would count as a logit of 0 everywhere: refused (one host read;
  // none on the meta device, which has no values: a dry run).
  if (targets.device().type != DeviceType::meta) {
    const std::vector<int64_t> bounds = stack({min(targets), max(targets)}).to(DType::i64).to_vector<int64_t>();
    ZG_CHECK(bounds[0] >= -1 && bounds[1] < vocab, op, ": targets ", describe(targets),
             " must be ids in [0, V = ", vocab, "), or -1 (ignored)");
  }
  const DType acc = accumulate_type(logits_shard.dtype());
  Tensor loss, probs, positions, owned, row_scale;
  {
    NoGradGuard no_grad;
    Backend& kernels = backend(logits_shard.device());
    const Tensor kept = ne(targets.view({n, 1}), -1.0).to(acc);
    row_scale = kept / sum(kept);  // the mean over the rows not ignored (none: NaN, as cross_entropy)
    const Tensor x = logits_shard.to(acc);
    Tensor top = max(x, {1}, true).contiguous();  // m, the max over all V, so that exp cannot overflow
    group.all_reduce(top, ReduceKind::max);
    // [N, V/T]: the one shard-sized buffer made here (16-bit logits: and x, their f32
    // copy, freed on return), worked on in place.
    probs = x - top;
    const nn::RowIds ids = nn::ids_in_rows(targets.view({n, 1}), group.rank() * columns, columns);
    // x[target] - m from the rank that holds the target, 0 from the others.
    Tensor picked = masked_fill(gather(probs, 1, ids.local), ids.outside, 0.0).contiguous();
    group.all_reduce(picked);
    kernels.unary(UnaryOp::exp, probs, probs);
    Tensor total = sum(probs, {1}, true).contiguous();  // sum over all V of exp(x - m)
    group.all_reduce(total);
    loss = sum((log(total) - picked) * row_scale);
    kernels.binary(BinaryOp::div, probs, total.expand(probs.shape()), probs);  // softmax(x), this rank's columns
    const Tensor row_starts =
        arange(0.0, double(n * columns), double(columns), TensorOptions(DType::i64).device(targets.device()));
    positions = (ids.local.view({n}).to(DType::i64) + row_starts).contiguous();
    owned = logical_not(ids.outside).to(acc).view({n, 1});
  }
  return differentiable(loss, kVocabParallelCrossEntropy, {logits_shard},
                        SoftmaxMinusOnehot{SavedTensor(probs), positions, owned, row_scale, logits_shard.dtype()});
}

}  // namespace zg::dist
