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
  if (std::string wrong = zeropp_problem(world_size); !wrong.empty()) return wrong;
  if (delayed_update_after < -1)
    return concat("ShardedModel: delayed_update_after must be >= 0 (-1: off), got ", delayed_update_after);
  if (delayed_update_after >= 0 && offload != Offload::optimizer)
    return concat("ShardedModel: delayed_update_after (the delayed parameter update) needs offload optimizer, whose "
                  "CPU AdamW it overlaps with the next step; offload ", name(offload),
                  offload == Offload::none ? " updates on the device" : " has the update write the shards the next "
                                                                        "forward gathers");
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

// hpZ and qgZ: what they change, the node they need, and what they cannot join.
std::string ZeroConfig::zeropp_problem(int world_size) const {
  const Placement policy = placement();
  const bool hybrid = shard_group_size != 0 && shard_group_size != world_size;
  if (secondary_weights && !policy.gathers_parameters())
    return concat("ShardedModel: secondary_weights (hpZ) keeps a node's copy of ZeRO-3's gathered weights; stage ", stage,
                  " gathers no weights before use (use stage 3)");
  if (gradient_bits != 0 && gradient_bits != 4 && gradient_bits != 8)
    return concat("ShardedModel: gradient_bits (qgZ) must be 4 or 8 (0: reduce unquantized), got ", gradient_bits);
  if (gradient_bits != 0 && !policy.frees_full_gradients())
    return concat("ShardedModel: gradient_bits (qgZ) quantizes the reduce-scatter of stages 2 and 3; stage ", stage,
                  stage == 0 ? " all-reduces" : " reduces into the full gradient", " (use stage 2 or 3)");
  if (gradient_bits != 0 && (gradient_block <= 0 || gradient_block % 2 != 0))
    return concat("ShardedModel: gradient_block (qgZ's elements a scale) must be positive and even, got ", gradient_block);
  if (gradient_bits != 0 && reduce_dtype)
    return concat("ShardedModel: gradient_bits (qgZ) sends ", gradient_bits, "-bit values and sums them in f32; leave "
                  "reduce_dtype unset (it was ", name(*reduce_dtype), ")");
  if ((secondary_weights || gradient_bits != 0) && hybrid)
    return concat("ShardedModel: ", secondary_weights ? "secondary_weights (hpZ)" : "gradient_bits (qgZ)",
                  " shards over all ", world_size, " ranks with nodes of ranks_per_node; hybrid sharding "
                  "(shard_group_size ", shard_group_size, ") keeps every collective within its group already");
  if (ranks_per_node < 0 || (ranks_per_node > 0 && world_size % ranks_per_node != 0))
    return concat("ShardedModel: ranks_per_node ", ranks_per_node, " must divide the ", world_size,
                  " data-parallel ranks (0: the mesh's)");
  if (secondary_weights && ranks_per_node >= world_size)
    return concat("ShardedModel: secondary_weights (hpZ) with every one of the ", world_size,
                  " ranks on one node would copy the shard it has; set ranks_per_node to a node's ranks");
  return "";
}

void ZeroConfig::check(int world_size) const {
  const std::string wrong = problem(world_size);
  ZG_CHECK(wrong.empty(), wrong);
}

}  // namespace zg::dist
