#include "dist/tensor/context_parallel.h"

#include <cmath>

#include "autograd/custom_op.h"
#include "dist/comm/differentiable.h"
#include "nn/gpt.h"
#include "nn/llama.h"
#include "tensor/backend.h"

namespace zg::dist {

const char* name(ContextVariant variant) {
  switch (variant) {
    case ContextVariant::ring: return "ring";
    case ContextVariant::all_gather: return "all_gather";
    case ContextVariant::ulysses: return "ulysses";
  }
  return "?";
}

ContextVariant parse_context_variant(std::string_view text) {
  if (text == "ring") return ContextVariant::ring;
  if (text == "all_gather" || text == "all-gather") return ContextVariant::all_gather;
  if (text == "ulysses") return ContextVariant::ulysses;
  fail("context parallelism: no variant '", text, "'; use ring, all_gather or ulysses");
}

namespace {

constexpr const char* kDestroyed =
    "context_attention: the context-parallel group was destroyed; keep it alive as long as the model";

// Rank r's pieces of 2C: slot 0 is piece r, slot 1 piece 2C - 1 - r.
int piece_of(int rank, int ranks, int slot) { return slot == 0 ? rank : 2 * ranks - 1 - rank; }

// The accumulation dtype of partial outputs, log-sum-exps and key/value gradients.
DType accumulate_dtype(DType dtype) { return dtype == DType::f64 ? DType::f64 : DType::f32; }

// A gradient over H repeated heads (zg::repeat_heads) summed back onto the H_kv heads they repeat.
Tensor sum_heads(const Tensor& g, int64_t kv_heads) {
  if (g.size(1) == kv_heads) return g;
  return sum(g.view({g.size(0), kv_heads, g.size(1) / kv_heads, g.size(2), g.size(3)}), {2});
}

// [B, H, L, D] views of fresh [B, L, H, D] buffers: the layout the fused kernels write.
Tensor bthd_like(const Tensor& t) {
  return empty({t.size(0), t.size(2), t.size(1), t.size(3)}, TensorOptions(t.dtype()).device(t.device())).transpose(1, 2);
}

// S = q k^T scale in the accumulation dtype; in a diagonal block, key j after query i masked.
Tensor block_scores(const Tensor& q, const Tensor& keys, bool diagonal, double scale) {
  const DType acc = accumulate_dtype(q.dtype());
  const Tensor scores = matmul(q.to(acc), keys.to(acc), false, true) * scale;
  if (!diagonal) return scores;
  const TensorOptions ids = TensorOptions(DType::i64).device(q.device());
  return masked_fill(scores, gt(arange(q.size(2), ids).unsqueeze(0), arange(q.size(2), ids).unsqueeze(1)), -INFINITY);
}

// One block's attention and its log-sum-exp: out = softmax(S) v, lse = logsumexp_j S_ij,
// S = q k^T scale (causal inside a diagonal block); keys and values repeated to q's heads.
// The fused kernel where the device has one (its stats are this lse), else composed in the
// accumulation dtype.
struct BlockResult {
  Tensor out, lse;  // accumulation dtype: [B, H, L, D], [B, H, L]
  bool fused = false;
};
BlockResult block_forward(const Tensor& q, const Tensor& keys, const Tensor& values, bool diagonal, double scale) {
  const DType acc = accumulate_dtype(q.dtype());
  const Tensor out = bthd_like(q);
  const Tensor stats = empty({q.size(0), q.size(1), q.size(2)}, TensorOptions(DType::f32).device(q.device()));
  // (requires_grad tells the backend a backward will follow, which it checks it can run)
  const auto input = [](const Tensor& t) { return t.contiguous().detach().set_requires_grad(true); };
  if (backend(q.device()).attention(input(q), input(keys), input(values), diagonal, scale, out, stats))
    return {out.to(acc), stats.to(acc), true};
  const Tensor scores = block_scores(q, keys, diagonal, scale);
  const Tensor lse = logsumexp(scores, {-1});
  return {matmul(exp(scores - lse.unsqueeze(-1)), values.to(acc)), lse};
}

// Merges a block into a query piece's running result by log-sum-exp (the online softmax).
void merge(BlockResult& total, const BlockResult& block) {
  if (!total.out.defined()) {
    total = block;
    return;
  }
  const Tensor top = maximum(total.lse, block.lse);
  const Tensor a = exp(total.lse - top), b = exp(block.lse - top), both = a + b;
  total.out = total.out * (a / both).unsqueeze(-1) + block.out * (b / both).unsqueeze(-1);
  total.lse = top + log(both);
  total.fused = block.fused;
}

// One block's gradients, given the whole rows' out, lse and output gradient g (so that the
// block's probabilities are P = exp(S - lse), as in the whole softmax):
//   dv = P^T g,  dS = P (g v^T - rowsum(g out)) scale,  dq = dS k,  dk = dS^T q.
// Keys and values repeated to q's heads; added into dq [B, H, L, D] and dk, dv [B, H_kv, L, D]
// (accumulation dtype).
struct BlockGrads {
  Tensor dq, dk, dv;
};
void block_backward(const Tensor& q, const Tensor& keys, const Tensor& values, const Tensor& out, const Tensor& lse,
                    const Tensor& g, bool diagonal, double scale, bool fused, BlockGrads into) {
  const DType acc = accumulate_dtype(q.dtype());
  const int64_t kv_heads = into.dk.size(1);
  if (fused) {
    // The fused backward reads out and lse as its forward wrote them: [B, L, H, D] and f32.
    Tensor o = bthd_like(q), grad = bthd_like(q);
    const Tensor dq = bthd_like(q), dk = bthd_like(keys), dv = bthd_like(values);
    o.copy_(out), grad.copy_(g);
    backend(q.device()).attention_backward(q.contiguous(), keys.contiguous(), values.contiguous(), o,
                                           lse.to(DType::f32).contiguous(), grad,
                                           diagonal, scale, dq, dk, dv);
    into.dq.add_(dq.to(acc));
    into.dk.add_(sum_heads(dk.to(acc), kv_heads));
    into.dv.add_(sum_heads(dv.to(acc), kv_heads));
    return;
  }
  const Tensor P = exp(block_scores(q, keys, diagonal, scale) - lse.unsqueeze(-1)), ga = g.to(acc);
  const Tensor delta = sum(ga * out.to(acc), {-1}, true);
  const Tensor dS = P * (matmul(ga, values.to(acc), false, true) - delta) * scale;
  into.dq.add_(matmul(dS, keys.to(acc)));
  into.dk.add_(sum_heads(matmul(dS, q.to(acc), true, false), kv_heads));
  into.dv.add_(sum_heads(matmul(P, ga, true, false), kv_heads));
}

// A rank's slot (0, 1) of a [B, H, 2L, D] tensor: its first or second piece's rows.
Tensor slot(const Tensor& t, int s) {
  const int64_t half = t.size(2) / 2;
  return t.narrow(2, s * half, half);
}

// Where the keys and values of rank `source` come from at each step: the ring (sent on
// from the previous rank while this one computes) or one all-gather.
class KeyValues {
 public:
  KeyValues(const Tensor& kv, ProcessGroup& group, ContextVariant variant) : group_(group), variant_(variant) {
    if (variant == ContextVariant::all_gather) {
      Shape shape = kv.shape();
      shape.insert(shape.begin(), group.size());
      gathered_ = empty(shape, TensorOptions(kv.dtype()).device(kv.device()));
      group.all_gather(kv.reshape({-1}), gathered_.reshape({-1}));
    } else {
      current_ = kv;
    }
  }
  // The stacked [2, B, H_kv, T, D] of `source` at `step`; posts the next step's hop first.
  Tensor at(int step, int source, bool more) {
    if (variant_ == ContextVariant::all_gather) return gathered_.select(0, source);
    if (step > 0) {
      hop_->wait();
      current_ = next_;
    }
    if (more) {
      next_ = empty_like(current_);
      hop_ = shift(group_, current_, next_);
    }
    return current_;
  }
  // Sends `mine` to the next rank and receives the previous rank's into `theirs`.
  // (Tag 1 for keys and values, 2 for their gradients: both may be on their way at once.)
  static WorkHandle shift(ProcessGroup& group, const Tensor& mine, const Tensor& theirs, int64_t tag = 1) {
    const int c = group.size(), r = group.rank();
    return group.batch_async({{P2POp::send, mine, (r + 1) % c, tag}, {P2POp::recv, theirs, (r + c - 1) % c, tag}});
  }

 private:
  ProcessGroup& group_;
  ContextVariant variant_;
  Tensor gathered_, current_, next_;
  WorkHandle hop_;
};

// The keys and values of a step, [2, B, H_kv, T, D], repeated to H heads once for its blocks.
struct RepeatedKeyValues {
  Tensor keys, values;
  RepeatedKeyValues(const Tensor& kv, int64_t heads)
      : keys(repeat_heads(kv.select(0, 0), heads)), values(repeat_heads(kv.select(0, 1), heads)) {}
};

// The ring and all-gather variants' forward: every block of the schedule, merged per query slot.
struct BlocksOut {
  Tensor out, lse;  // [B, H, T, D] in q's dtype; [B, H, T] accumulation dtype
  bool fused = false;
};
BlocksOut blocks_forward(const Tensor& q, const Tensor& k, const Tensor& v, ProcessGroup& group, ContextVariant variant,
                         double scale) {
  NoGradGuard no_grad;
  const int c = group.size();
  KeyValues source(stack({k, v}).contiguous(), group, variant);
  BlockResult rows[2];
  const std::vector<AttentionBlock> schedule = context_schedule(group.rank(), c);
  for (int step = 0; step < c; ++step) {
    const int from = (group.rank() - step + c) % c;
    const RepeatedKeyValues kv(source.at(step, from, step + 1 < c), q.size(1));
    for (const AttentionBlock& b : schedule)
      if (b.step == step)
        merge(rows[b.query_slot], block_forward(slot(q, b.query_slot), slot(kv.keys, b.key_slot),
                                                slot(kv.values, b.key_slot), b.diagonal, scale));
  }
  Tensor out = bthd_like(q);  // so that the model's transpose back to [B, T, H D] is free
  out.copy_(cat({rows[0].out, rows[1].out}, 2));
  return {out, cat({rows[0].lse, rows[1].lse}, 2), rows[0].fused};
}

// Their backward: the blocks again, each adding into dq and into the gradient of the keys
// and values it read -- which travels round the ring with them and reaches its owner after
// C hops, or is reduce-scattered to it after an all-gather.
std::vector<Tensor> blocks_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                    const Tensor& lse, const Tensor& g, ProcessGroup& group, ContextVariant variant,
                                    double scale, bool fused) {
  const int c = group.size(), r = group.rank();
  const DType acc = accumulate_dtype(q.dtype());
  const Tensor kv = stack({k, v}).contiguous();
  const TensorOptions acc_options = TensorOptions(acc).device(q.device());
  KeyValues source(kv, group, variant);
  const Tensor dq = zeros(q.shape(), acc_options);
  Shape all = kv.shape();
  all.insert(all.begin(), variant == ContextVariant::all_gather ? c : 1);
  const Tensor dkv_all = zeros(all, acc_options);  // ring: the travelling [1, 2, ..]; all_gather: one per source
  Tensor dkv = dkv_all.select(0, 0);
  const std::vector<AttentionBlock> schedule = context_schedule(r, c);
  for (int step = 0; step < c; ++step) {
    const int from = (r - step + c) % c;
    const RepeatedKeyValues keys_values(source.at(step, from, step + 1 < c), q.size(1));
    if (variant == ContextVariant::all_gather) dkv = dkv_all.select(0, from);
    for (const AttentionBlock& b : schedule) {
      if (b.step != step) continue;
      block_backward(slot(q, b.query_slot), slot(keys_values.keys, b.key_slot), slot(keys_values.values, b.key_slot),
                     slot(out, b.query_slot), slot(lse, b.query_slot),
                     slot(g, b.query_slot), b.diagonal, scale, fused,
                     {slot(dq, b.query_slot), slot(dkv.select(0, 0), b.key_slot), slot(dkv.select(0, 1), b.key_slot)});
    }
    if (variant == ContextVariant::ring && c > 1) {  // the gradient moves on with its keys and values
      const Tensor arriving = empty_like(dkv);
      KeyValues::shift(group, dkv, arriving, 2)->wait();
      dkv = arriving;
    }
  }
  if (variant == ContextVariant::all_gather) {
    dkv = empty(kv.shape(), acc_options);
    group.reduce_scatter(dkv_all.reshape({-1}), dkv.reshape({-1}));
  }
  return {dq.to(q.dtype()), dkv.select(0, 0).to(k.dtype()), dkv.select(0, 1).to(v.dtype())};
}

Tensor blocks_attention(const Tensor& q, const Tensor& k, const Tensor& v, ProcessGroup& group, ContextVariant variant) {
  static const CustomOp op("context_attention");
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  const BlocksOut result = blocks_forward(q, k, v, group, variant, scale);
  const GroupRef g(group, kDestroyed);
  return op.apply(result.out, {q, k, v},
                  [q = SavedTensor(q), k = SavedTensor(k), v = SavedTensor(v), out = SavedTensor(result.out),
                   lse = SavedTensor(result.lse), g, variant, scale, fused = result.fused](const Tensor& grad) {
                    const char* name = "context_attention";
                    return blocks_backward(q.get(name), k.get(name), v.get(name), out.get(name), lse.get(name),
                                           grad, *g, variant, scale, fused);
                  });
}

// Ulysses' all-to-all, sequence split -> head split: x [B, H, T, D] (this rank's pieces of
// every head) -> [B, H / C, S, D] (this rank's heads, every row, in sequence order).
Tensor sequence_to_heads(const Tensor& x, ProcessGroup& group) {
  NoGradGuard no_grad;
  const int c = group.size();
  const int64_t batch = x.size(0), heads = x.size(1) / c, rows = x.size(2), dim = x.size(3);
  // chunk j: the heads rank j will hold, [C, B, H / C, T, D]
  const Tensor sent = x.reshape({batch, c, heads, rows, dim}).transpose(0, 1).contiguous();
  const Tensor received = empty_like(sent);  // chunk i: rank i's pieces of this rank's heads
  group.all_to_all_async({sent.reshape({-1})}, {received.reshape({-1})})->wait();
  std::vector<Tensor> sequence;  // piece p of 2C lies in slot (p >= C) of rank (p < C ? p : 2C - 1 - p)
  for (int p = 0; p < 2 * c; ++p) sequence.push_back(slot(received.select(0, p < c ? p : 2 * c - 1 - p), p < c ? 0 : 1));
  return cat(sequence, 2);
}

// Its inverse, [B, H / C, S, D] -> [B, H, T, D].
Tensor heads_to_sequence(const Tensor& y, ProcessGroup& group) {
  NoGradGuard no_grad;
  const int c = group.size();
  const int64_t piece = y.size(2) / (2 * c);
  std::vector<Tensor> chunks;  // chunk j: rank j's two pieces of this rank's heads
  for (int j = 0; j < c; ++j)
    chunks.push_back(cat({y.narrow(2, piece_of(j, c, 0) * piece, piece), y.narrow(2, piece_of(j, c, 1) * piece, piece)}, 2));
  const Tensor sent = stack(chunks).contiguous();  // [C, B, H / C, T, D]
  const Tensor received = empty_like(sent);        // chunk i: rank i's heads of this rank's pieces
  group.all_to_all_async({sent.reshape({-1})}, {received.reshape({-1})})->wait();
  const Tensor heads = received.permute({1, 3, 0, 2, 4});  // [B, T, C, H / C, D]
  Tensor out = empty(heads.shape(), TensorOptions(y.dtype()).device(y.device()));  // [B, T, H, D]: see blocks_forward
  out.copy_(heads);
  return out.view({heads.size(0), heads.size(1), c * heads.size(3), heads.size(4)}).transpose(1, 2);
}

// The two as differentiable ops, each the other's backward.
Tensor to_heads(const Tensor& x, ProcessGroup& group);
Tensor to_sequence(const Tensor& y, ProcessGroup& group) {
  static const CustomOp op("ulysses_heads_to_sequence");
  const GroupRef g(group, kDestroyed);
  return op.apply(heads_to_sequence(y, group), {y},
                  [g](const Tensor& grad) { return std::vector<Tensor>{sequence_to_heads(grad.contiguous(), *g)}; });
}
Tensor to_heads(const Tensor& x, ProcessGroup& group) {
  static const CustomOp op("ulysses_sequence_to_heads");
  const GroupRef g(group, kDestroyed);
  return op.apply(sequence_to_heads(x, group), {x},
                  [g](const Tensor& grad) { return std::vector<Tensor>{heads_to_sequence(grad.contiguous(), *g)}; });
}

// With dropout, this rank's heads are part rank of C of the part its q holds of the model's.
Tensor ulysses_attention(const Tensor& q, const Tensor& k, const Tensor& v, ProcessGroup& group,
                         const nn::AttentionDropout& dropout) {
  const int c = group.size();
  ZG_CHECK(q.size(1) % c == 0 && k.size(1) % c == 0, "context_attention (ulysses): the ", q.size(1),
           " query heads and ", k.size(1), " key/value heads a rank holds must both divide by the cp group's C = ", c,
           " (each rank takes 1/C of them); use the ring or all_gather variant");
  const Tensor heads = scaled_dot_product_attention(to_heads(q, group), to_heads(k, group), to_heads(v, group), true,
                                                    dropout.p, true, dropout.head_part * c + group.rank(),
                                                    dropout.head_parts * c);
  return to_sequence(heads, group);
}

}  // namespace

Tensor context_shard(const Tensor& whole, int rank, int ranks, int64_t dim) {
  ZG_CHECK(whole.defined() && dim >= 0 && dim < whole.dim(), "context_shard: no dim ", dim, " in ",
           whole.defined() ? describe(whole) : std::string("an undefined tensor"));
  if (ranks == 1) return whole;
  ZG_CHECK(whole.size(dim) % (2 * ranks) == 0, "context_shard: a sequence of ", whole.size(dim),
           " does not cut into the 2 x ", ranks, " equal pieces context parallelism over ", ranks,
           " ranks needs; make the length a multiple of ", 2 * ranks);
  const nn::SequencePieces pieces = nn::load_balanced_pieces(rank, ranks);
  const int64_t n = whole.size(dim) / pieces.parts;
  std::vector<Tensor> mine;
  for (int h : pieces.held) mine.push_back(whole.narrow(dim, h * n, n));
  return cat(mine, dim);
}

Tensor context_unshard(const Tensor& pieces, ProcessGroup& group, int64_t dim) {
  const int c = group.size();
  if (c == 1) return pieces;
  ZG_CHECK(pieces.size(dim) % 2 == 0, "context_unshard: ", describe(pieces), " does not hold two pieces along dim ", dim);
  const Tensor ranks = gather_from_sequence(pieces, group, dim);  // rank order: r's slot 0, slot 1, ...
  const int64_t n = pieces.size(dim) / 2;
  std::vector<Tensor> sequence;
  for (int p = 0; p < 2 * c; ++p) {
    const int owner = p < c ? p : 2 * c - 1 - p;
    sequence.push_back(ranks.narrow(dim, (2 * owner + (p < c ? 0 : 1)) * n, n));
  }
  return cat(sequence, dim);
}

std::vector<AttentionBlock> context_schedule(int rank, int ranks) {
  ZG_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "context_schedule: rank ", rank, " of ", ranks);
  std::vector<AttentionBlock> blocks;
  for (int step = 0; step < ranks; ++step) {
    const int source = (rank - step + ranks) % ranks;
    for (int qs = 0; qs < 2; ++qs)
      for (int ks = 0; ks < 2; ++ks) {
        const int query = piece_of(rank, ranks, qs), key = piece_of(source, ranks, ks);
        if (key <= query) blocks.push_back({step, source, qs, ks, query, key, key == query});
      }
  }
  return blocks;
}

Tensor context_attention(const Tensor& q, const Tensor& k, const Tensor& v, ProcessGroup& group,
                         ContextVariant variant, const nn::AttentionDropout& dropout) {
  ZG_CHECK(q.defined() && k.defined() && v.defined() && q.dim() == 4 && k.dim() == 4 && v.dim() == 4 &&
               k.shape() == v.shape() && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3) &&
               k.size(1) > 0 && q.size(1) % k.size(1) == 0,
           "context_attention: expected q [B, H, T, D] and k, v [B, H_kv, T, D] with H_kv dividing H, got ",
           q.defined() ? describe(q) : "undefined", ", ", k.defined() ? describe(k) : "undefined", ", ",
           v.defined() ? describe(v) : "undefined");
  if (group.size() == 1)
    return scaled_dot_product_attention(q, k, v, true, dropout.p, true, dropout.head_part, dropout.head_parts);
  ZG_CHECK(q.size(2) % 2 == 0, "context_attention: ", q.size(2), " rows are not this rank's two equal pieces of the ",
           "sequence (shard tokens with context_shard)");
  if (variant == ContextVariant::ulysses) return ulysses_attention(q, k, v, group, dropout);
  ZG_CHECK(dropout.p == 0, "context_attention (", name(variant), "): attention dropout (p = ", dropout.p, ") does not "
           "run on the ", name(variant), " variant, whose blocks are parts of the probabilities' rows; use ulysses (whole "
           "rows of a rank's heads), or dropout 0");
  return blocks_attention(q, k, v, group, variant);
}

void parallelize_context(nn::CausalLM& model, ProcessGroup& group, ContextVariant variant) {
  if (group.size() == 1) return;
  const GroupRef g(group, kDestroyed);
  const nn::CausalAttention attention = [g, variant](const Tensor& q, const Tensor& k, const Tensor& v,
                                                     const nn::AttentionDropout& dropout) {
    return context_attention(q, k, v, *g, variant, dropout);
  };
  const nn::SequencePieces pieces = nn::load_balanced_pieces(group.rank(), group.size());
  int attentions = 0;
  for (const auto& [path, module] : model.named_modules()) {
    if (auto* gpt = dynamic_cast<nn::CausalSelfAttention*>(module)) gpt->context_attention = attention, ++attentions;
    if (auto* llama = dynamic_cast<nn::LlamaAttention*>(module)) llama->context_attention = attention, ++attentions;
    if (auto* drop = dynamic_cast<nn::Dropout*>(module)) drop->sequence = pieces, drop->part_dim = 1;
  }
  ZG_CHECK(attentions > 0, "parallelize_context: the model has no attention module it knows (GPT's "
           "CausalSelfAttention, Llama's LlamaAttention); set context_attention on your own");
  model.set_sequence_pieces(pieces);
}

ContextBytes context_attention_bytes(ContextVariant variant, int ranks, int64_t batch, int64_t rows, int64_t heads,
                                     int64_t kv_heads, int64_t head_dim, int64_t element, int64_t accumulate) {
  const int64_t c = ranks, kv = 2 * batch * kv_heads * rows * head_dim * element,
                dkv = kv / element * accumulate, q = batch * heads * rows * head_dim * element;
  if (c == 1) return {};
  switch (variant) {
    case ContextVariant::ring: return {(c - 1) * kv, (c - 1) * kv + c * dkv};
    case ContextVariant::all_gather: return {(c - 1) * kv, (c - 1) * kv + (c - 1) * dkv};
    case ContextVariant::ulysses: {
      const int64_t moved = (c - 1) * (2 * q + kv) / c;
      return {moved, moved};
    }
  }
  return {};
}

}  // namespace zg::dist
