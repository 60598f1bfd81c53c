#include "dist/zero/zero_config.h"

#include <cmath>

namespace zg::dist {

std::string ZeroConfig::problem(int world_size) const {
  if (std::string wrong = Placement::problem(stage, offload); !wrong.empty()) return wrong;
  const Placement policy = placement();
  const int s = shard_group_size;
  if (s < 0 || (s != 0 && (world_size < 1 || world_size % s != 0)))
    return concat("ShardedModel: shard_group_size ", s, " must divide the group's ", world_size,
                  " ranks (0: shard over all of them)");
  if (s != 0 && s != world_size && !policy.frees_full_gradients())
    return concat("ShardedModel: shard_group_size ", s, " (hybrid sharding) needs stage 2 or 3, whose unit gradients "
                  "are reduce-scattered and freed; stage ", stage,
                  stage == 0 ? " shards nothing" : " keeps the full gradient, summed into slice r");
  for (const auto& [what, dtype] : {std::pair{"compute", compute_dtype}, {"reduce", reduce()}, {"accumulate", accumulate()}})
    if (!is_floating(dtype)) return concat("ShardedModel: ", what, " dtype must be floating, got ", name(dtype));
  if (accumulate() != compute_dtype && !policy.frees_full_gradients())
    return concat("ShardedModel: accumulate_dtype ", name(accumulate()), " needs stage 2 or 3, whose gradient shard "
                  "sums the micro-batches; stage ", stage, " accumulates in the full ", name(compute_dtype),
                  " gradient autograd writes (leave accumulate_dtype unset)");
  if (reduce_once && !policy.frees_full_gradients())
    return concat("ShardedModel: reduce_once is for stages 2 and 3, which otherwise reduce each micro-batch; stage ",
                  stage, " keeps the full gradient and reduces a Pipeline's micro-batches once anyway");
  if (quantize_weights && !policy.gathers_parameters())
    return concat("ShardedModel: quantize_weights (qwZ) quantizes ZeRO-3's weight all-gathers; stage ", stage,
                  " gathers no weights before use (use stage 3)");
  if (bucket_bytes <= 0) return concat("ShardedModel: bucket_bytes must be positive, got ", bucket_bytes);
  if (prefetch < 0) return concat("ShardedModel: prefetch must be >= 0, got ", prefetch);
  if (prefetch_bytes < 0)
    return concat("ShardedModel: prefetch_bytes must be >= 0 (0: no bound), got ", prefetch_bytes);
  if (!std::isfinite(max_grad_norm) || max_grad_norm < 0)
    return concat("ShardedModel: max_grad_norm must be >= 0 and finite (0 disables clipping), got ", max_grad_norm);
  if (!keep_after_forward.empty() && !policy.gathers_parameters())
    return concat("ShardedModel: keep_after_forward is for stage 3, where units are gathered around each use; stage ",
                  stage, " keeps every weight whole");
  try {
    optim::check_options(adamw);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void ZeroConfig::check(int world_size) const {
  const std::string wrong = problem(world_size);
  ZG_CHECK(wrong.empty(), wrong);
}

}  // namespace zg::dist
