// zero_memory --cp C: what a rank of a context-parallel group sends and keeps, by formula,
// beside what a dry run measures (dist/tensor/context_parallel.h).
//
//   bytes sent    each layer's attention, forward and backward, as
//                 dist::context_attention_bytes counts it for the variant (the forward again
//                 where activation checkpointing recomputes it), with T = s / C rows a rank
//                 and a tp rank's heads
//   activations   a layer as this code keeps it on b T tokens a rank (T = s / C), and the
//                 step's peak, in the head's backward: L layers and the head's tail. A GPT's
//                 layer (uncut: its MLP one op, keeping the GELU's input only): the norms' and
//                 the projections' inputs 4c h, q, k, v and out 4c h, the GELU's input 4c h,
//                 the f32 lse 4H and the norms' statistics 16 a token (Ulysses: the out again,
//                 c h); its tail: ln_f's input, output and their gradient 3c h, ln_f's
//                 statistics and the loss's lse 12, the logits c V a token, the tied
//                 embedding's gradient c V h, and 8. A Llama's layer, c bytes an element, h
//                 wide, h_kv its keys' width, I the SwiGLU's, H heads of D:
//                   each RMSNorm   its f32 input (16-bit: the cast; f32: the input itself) 4h,
//                                  1/rms 4, the normalised x and its weighted output 2c h
//                   attention      rope(q), rope(k), v, out: c (2h + 2h_kv); the f32 lse 4H
//                                  (Ulysses: the out again after the all-to-all, c h, and with
//                                  grouped-query heads the repeated k, v, 2c (h - h_kv))
//                   SwiGLU         gate, sigmoid(gate), silu(gate), up, and their product 5c I
//                 and its tail: the logits c V, the final norm's (above) and the gradient of
//                 its output c h a token, the rotary tables 2c D a position, the head's
//                 weight gradient c V h (and a scalar, 8). Measured equal to the byte.
#pragma once

#include <cstdint>

#include "bench/model_shape.h"
#include "dist/tensor/context_parallel.h"

namespace zg::bench {

// How a model is cut besides ZeRO: --tp (with --sequence-parallel) and --cp.
struct ModelCut {
  int tp = 1;
  bool sp = false;
  int cp = 1;
  dist::ContextVariant cp_variant = dist::ContextVariant::ring;
};

struct ContextFormula {
  int64_t sent = 0;         // a step's bytes on the cp group
  int64_t layer = 0, peak = 0;  // activations: one layer's, the step's peak (0: no formula for this cut)
};

inline ContextFormula formula_context(const ModelShape& shape, int64_t b, int64_t s, const ModelCut& cut, DType compute) {
  const int64_t c = element_size(compute), t = s / cut.cp;
  const int64_t heads = shape.heads() / cut.tp, kv_heads = shape.kv_heads() / cut.tp, d = shape.width() / shape.heads();
  const bool recompute = shape.visit([](const auto& config) { return config.activation_checkpointing; });
  const dist::ContextBytes layer = dist::context_attention_bytes(cut.cp_variant, cut.cp, b, t, heads, kv_heads, d, c,
                                                                 c == 8 ? 8 : 4);
  ContextFormula f;
  f.sent = shape.layers() * ((recompute ? 2 : 1) * layer.forward + layer.backward);
  if (cut.tp > 1 || cut.sp || recompute) return f;  // activations: no formula for these cuts
  const bool ulysses = cut.cp_variant == dist::ContextVariant::ulysses;
  const int64_t h = shape.width(), v = shape.vocab(), n = b * t;
  if (shape.is_gpt()) {
    f.layer = n * ((ulysses ? 13 : 12) * c * h + 4 * shape.heads() + 16);
    f.peak = shape.layers() * f.layer + n * (3 * c * h + 12 + c * v) + c * v * h + 8;
    return f;
  }
  const nn::LlamaConfig& l = std::get<nn::LlamaConfig>(shape.config);
  const int64_t hk = l.n_kv_head * d, i = nn::intermediate_size(l);
  const int64_t norm = (c == 2 ? 4 * h : c * h) + 4 + 2 * c * h;
  const int64_t again = ulysses ? c * h + 2 * c * (h - hk) : 0;
  f.layer = n * (2 * norm + c * (2 * h + 2 * hk) + 4 * l.n_head + again + 5 * c * i);
  f.peak = shape.layers() * f.layer + n * (c * v + norm + c * h) + t * 2 * c * d + c * v * h + 8;
  return f;
}

}  // namespace zg::bench
