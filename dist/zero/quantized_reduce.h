// qgZ (ZeRO++, Wang et al. 2023): ZeRO's gradient reduce-scatter as two all-to-alls of
// blockwise-quantized gradients -- the paper's hierarchical all-to-all. N = R S ranks, S a
// node; rank r = k S + j (node k, node rank j) ends with slice r of the average:
//   1. within the node: the gradient's N slices reordered so that the R bound for node rank
//      j' lie together (the paper's tensor slice reordering), quantized per destination,
//      all-to-all; each rank dequantizes its S peers' copies of its R slices and sums them
//      in f32 -- the node's sum of the slices of node rank j on every node;
//   2. across nodes, among the R ranks of node rank j: those sums quantized per node,
//      all-to-all; each rank dequantizes the R node sums of slice r, sums them in f32 and
//      divides by N.
// A quantization per hop, not one per ring step (which would compound the error). Bytes a
// rank sends, b = bits / 8 + 4 / block an element: (S-1)/S P b within its node and
// (R-1)/R P/S b across -- with int4, about an eighth of a bf16 ring's bytes to the other
// nodes, per node.
#pragma once

#include "dist/comm/process_group.h"
#include "dist/zero/unit.h"

namespace zg::dist {

// Starts reducing `full` ([P], floating, P a multiple of N; of 2 N at 4 bits) over the S
// ranks of `node` times the R of `across` into `out` ([P / N] f32): the average of every
// rank's `full`, slice node.rank() + S across.rank(), quantized to `bits` in blocks of
// `block` elements. Hop 2 starts in the returned reduction's `then`, and `finish` runs
// after it. Payloads are `communication` bytes.
InFlight quantized_reduce_scatter(ProcessGroup& node, ProcessGroup& across, const Tensor& full, const Tensor& out,
                                  int bits, int64_t block, std::function<InFlight()> finish);

}  // namespace zg::dist
