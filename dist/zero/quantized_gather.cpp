#include "dist/zero/quantized_gather.h"

#include <algorithm>

#include "tensor/backend.h"
#include "tensor/quantize.h"

namespace zg::dist {

namespace {

// Both gathers, then every rank's slice dequantized with its own scales in one pass (a
// rank's blocks start at its slice: tensor/quant_blocks.h's segments).
class QuantizedGather final : public Work {
 public:
  QuantizedGather(WorkHandle values, WorkHandle scales, Tensor gathered_values, Tensor gathered_scales, Tensor full,
                  int ranks)
      : values_(std::move(values)), scales_(std::move(scales)), gathered_values_(std::move(gathered_values)),
        gathered_scales_(std::move(gathered_scales)), full_(std::move(full)), ranks_(ranks) {}

  void wait() override {
    if (done_) return;
    values_->wait();
    scales_->wait();
    backend(full_.device())
        .dequantize_blocks(gathered_values_, gathered_scales_, 8, kQuantizationBlock, std::max<int64_t>(full_.numel() / ranks_, 1),
                         full_);
    gathered_values_ = gathered_scales_ = Tensor();  // the payload, freed
    done_ = true;
  }
  bool completed() const override { return done_ || (values_->completed() && scales_->completed()); }

 private:
  WorkHandle values_, scales_;
  Tensor gathered_values_, gathered_scales_, full_;
  int ranks_;
  bool done_ = false;
};

}  // namespace

WorkHandle quantized_all_gather_async(ProcessGroup& group, const Tensor& shard, const Tensor& full) {
  ZG_CHECK(full.numel() == shard.numel() * group.size() && full.dtype() == shard.dtype(),
           "quantized all-gather: the full buffer ", describe(full), " must hold ", group.size(), " shards like ",
           describe(shard));
  MemoryScope scope(MemoryCategory::communication);
  const Quantized mine = quantize(shard);
  const TensorOptions on = TensorOptions(DType::i8).device(full.device());
  Tensor values = Tensor::empty({full.numel()}, on);
  Tensor scales = Tensor::empty({mine.scales.numel() * group.size()}, on.dtype(DType::f32));
  WorkHandle values_work = group.all_gather_async(mine.values, values);
  WorkHandle scales_work = group.all_gather_async(mine.scales, scales);
  return std::make_shared<QuantizedGather>(std::move(values_work), std::move(scales_work), std::move(values),
                                           std::move(scales), full, group.size());
}

}  // namespace zg::dist
