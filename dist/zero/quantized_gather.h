// qwZ (ZeRO++, Wang et al. 2023): ZeRO-3's weight all-gather sent as blockwise int8.
// Each rank quantizes its shard (tensor/quantize.h: a scale per 2048 elements), the int8
// values and the scales are all-gathered, and on arrival every rank's slice is
// dequantized into the full compute weights -- 1 + 4/2048 bytes an element on the wire
// instead of 2 (bf16). Only the gathered copy is approximate: the master weights, the
// shards and the optimizer never see quantized values.
#pragma once

#include "dist/comm/process_group.h"

namespace zg::dist {

// Starts gathering this rank's `shard` ([s], floating) into `full` ([S s], the shard's
// dtype) over `group`, quantized; the returned work's wait() dequantizes. The payload's
// buffers are `communication` bytes, freed once dequantized.
WorkHandle quantized_all_gather_async(ProcessGroup& group, const Tensor& shard, const Tensor& full);

}  // namespace zg::dist
