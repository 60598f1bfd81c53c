#include "dist/zero/quantized_reduce.h"

#include "tensor/backend.h"
#include "tensor/quantize.h"

namespace zg::dist {

namespace {

// One hop: `x` ([n c]) quantized in blocks restarting at each rank's chunk, the values and
// scales sent all-to-all over `group`; `values` and `scales` receive the n ranks' chunks.
struct Hop {
  Tensor values, scales;  // received: chunk i from rank i
  int64_t chunk = 0, block = 1;
  int bits = 8;
  WorkHandle work;

  Hop(ProcessGroup& group, const Tensor& x, int bits, int64_t block)
      : chunk(x.numel() / group.size()), block(block), bits(bits) {
    MemoryScope scope(MemoryCategory::communication);
    const QuantBlocks layout{x.numel(), block, chunk, bits};
    const TensorOptions on = TensorOptions(DType::i8).device(x.device());
    const Tensor sent_values = Tensor::empty({layout.bytes()}, on);
    const Tensor sent_scales = Tensor::empty({layout.count()}, on.dtype(DType::f32));
    backend(x.device()).quantize_blocks(x, bits, block, chunk, sent_values, sent_scales);
    values = Tensor::empty({layout.bytes()}, on);
    scales = Tensor::empty({layout.count()}, on.dtype(DType::f32));
    work = group.all_to_all_async({sent_values, sent_scales}, {values, scales});
  }

  // The n chunks that arrived, dequantized in f32 and summed in rank order, into `sum` ([c] f32).
  void sum_into(const Tensor& sum) {
    MemoryScope scope(MemoryCategory::communication);
    Backend& b = backend(sum.device());
    const Tensor each = Tensor::empty({values.numel() * 8 / bits}, TensorOptions(DType::f32).device(sum.device()));
    b.dequantize_blocks(values, scales, bits, block, chunk, each);
    b.copy(each.narrow(0, 0, chunk), sum);
    for (int64_t i = chunk; i < each.numel(); i += chunk) b.binary(BinaryOp::add, sum, each.narrow(0, i, chunk), sum);
    values = scales = Tensor();
  }
};

}  // namespace

InFlight quantized_reduce_scatter(ProcessGroup& node, ProcessGroup& across, const Tensor& full, const Tensor& out,
                                  int bits, int64_t block, std::function<InFlight()> finish) {
  const int s = node.size(), r = across.size();
  const int64_t slice = full.numel() / (s * r);
  ZG_CHECK(slice * s * r == full.numel() && out.numel() == slice && out.dtype() == DType::f32, "qgZ: the gradient ",
           describe(full), " must be ", s * r, " slices of the f32 output ", describe(out));
  // Slice k' S + j' sits at [k'][j'] of [R, S, slice]; node rank j' is sent [j'][k'] for every k'.
  Tensor reordered;
  {
    MemoryScope scope(MemoryCategory::communication);
    reordered = full.view({r, s, slice}).transpose(0, 1).contiguous().view({full.numel()});
  }
  auto first = std::make_shared<Hop>(node, reordered, bits, block);
  InFlight job{first->work, {}};
  job.then = [first, &across, out, bits, block, n = s * r, finish = std::move(finish), tag = CollectiveTag::current()] {
    Tensor node_sum;  // [R, slice]: this node's sum of slice k' S + j for every k'
    {
      MemoryScope scope(MemoryCategory::communication);
      node_sum = Tensor::empty({first->chunk}, TensorOptions(DType::f32).device(out.device()));
    }
    first->sum_into(node_sum);
    CollectiveTag scope(tag);
    auto second = std::make_shared<Hop>(across, node_sum, bits, block);
    return InFlight{second->work, [second, out, n, finish] {
                      second->sum_into(out);
                      Tensor(out).mul_(1.0 / static_cast<double>(n));
                      return finish();
                    }};
  };
  return job;
}

}  // namespace zg::dist
