#include "dist/tensor/parallelize.h"

#include <fnmatch.h>

#include <unordered_set>

#include "autograd/graph.h"
#include "dist/comm/differentiable.h"
#include "dist/tensor/vocab_parallel.h"
#include "nn/causal_lm.h"
#include "nn/layers.h"
#include "tensor/deferred.h"

namespace zg::dist {

namespace {

using nn::ParallelRule;
using nn::ParallelStyle;
using nn::TensorSplit;

constexpr const char* kDestroyed =
    "parallelize_module: the tensor-parallel group was destroyed; keep it alive as long as the model";

// A module a rule names, with the parameters that rule cuts and how.
struct Cut {
  std::string path;
  nn::Module* module;
  const ParallelRule* rule;
  std::vector<std::pair<std::string, TensorSplit>> parameters;  // local names
};

std::string where(const Cut& cut) {
  std::string chunks = cut.rule->chunks > 1 ? ", " + std::to_string(cut.rule->chunks) + " chunks" : "";
  return "parallelize_module: " + cut.path + " (" + nn::name(cut.rule->style) + chunks + ")";
}

// A module's own parameter by its local name.
Tensor parameter_of(const Cut& cut, const std::string& local) {
  for (const auto& [name, p] : cut.module->named_parameters())
    if (name == local) return p;
  fail(where(cut), ": no parameter '", local, "'");
}

// What a rule cuts in one module: a Linear's weight rows (and bias) or columns, an
// Embedding's rows; nothing for the seams. The sizes are checked against T here.
std::vector<std::pair<std::string, TensorSplit>> split_of(const Cut& cut, int world, int rank) {
  const ParallelRule& rule = *cut.rule;
  ZG_CHECK(rule.style != ParallelStyle::sequence_dropout || dynamic_cast<nn::Dropout*>(cut.module) != nullptr,
           where(cut), ": the module is not an nn::Dropout");
  if (rule.style == ParallelStyle::copy_output || rule.style == ParallelStyle::sequence_norm ||
      rule.style == ParallelStyle::scatter_input || rule.style == ParallelStyle::sequence_dropout)
    return {};  // nothing cut
  if (rule.style == ParallelStyle::vocab_embedding) {
    const auto* embedding = dynamic_cast<nn::Embedding*>(cut.module);
    ZG_CHECK(embedding != nullptr, where(cut), ": the module is not an nn::Embedding");
    ZG_CHECK(embedding->weight.size(0) % world == 0, where(cut), ": num_embeddings ", embedding->weight.size(0),
             " does not divide by the tensor-parallel group's size T = ", world);
    return {{"weight", {0, 1, world, rank}}};
  }
  const auto* linear = dynamic_cast<nn::Linear*>(cut.module);
  ZG_CHECK(linear != nullptr, where(cut), ": the module is not an nn::Linear");
  if (rule.style == ParallelStyle::rowwise) {
    ZG_CHECK(linear->activation == Activation::none, where(cut),
             ": a rowwise layer cannot apply an activation (it would act on each rank's partial sum)");
    ZG_CHECK(linear->weight.size(1) % world == 0, where(cut), ": in_features ", linear->weight.size(1),
             " does not divide by the tensor-parallel group's size T = ", world);
    return {{"weight", {1, 1, world, rank}}};  // the bias stays whole, added after the sum
  }
  const int64_t out = linear->weight.size(0);
  ZG_CHECK(rule.chunks >= 1 && out % (rule.chunks * world) == 0, where(cut), ": out_features ", out,
           " does not divide into ", rule.chunks, " chunk(s) of T = ", world, " equal parts");
  std::vector<std::pair<std::string, TensorSplit>> out_split{{"weight", {0, rule.chunks, world, rank}}};
  if (linear->bias.defined()) out_split.push_back({"bias", {0, rule.chunks, world, rank}});
  return out_split;
}

// Every module each rule names, checked before anything changes.
std::vector<Cut> plan_cuts(nn::Module& model, const nn::ParallelPlan& plan, int world, int rank) {
  ZG_CHECK(!plan.rules.empty(), "parallelize_module: the plan names no module; give the model a parallel_plan() "
           "or pass a plan");
  for (const auto& [count_name, count] : plan.must_divide)
    ZG_CHECK(count % world == 0, "parallelize_module: the model's ", count_name, " ", count,
             " does not divide by the tensor-parallel group's size T = ", world);
  std::vector<Cut> cuts;
  std::unordered_set<const nn::Module*> taken;
  const auto modules = model.named_modules();
  for (const ParallelRule& rule : plan.rules) {
    bool matched = false;
    for (const auto& [path, module] : modules) {
      if (path.empty() || fnmatch(rule.module.c_str(), path.c_str(), 0) != 0) continue;
      matched = true;
      ZG_CHECK(taken.insert(module).second, "parallelize_module: ", path, " is named by more than one rule");
      Cut cut{path, module, &rule, {}};
      cut.parameters = split_of(cut, world, rank);
      cuts.push_back(std::move(cut));
    }
    ZG_CHECK(matched, "parallelize_module: rule '", rule.module, "' (", nn::name(rule.style),
             ") matches no module of the model");
  }
  std::unordered_set<const TensorImpl*> cut_once;  // a tied weight named by two rules would be cut twice
  for (const Cut& cut : cuts)
    for (const auto& [local, _] : cut.parameters)
      ZG_CHECK(cut_once.insert(&parameter_of(cut, local).impl()).second, where(cut), ": its ", local,
               " is shared with a module another rule cuts (a tied weight is cut once)");
  for (const auto& [path, module] : modules) {
    const auto* drop = dynamic_cast<const nn::Dropout*>(module);
    ZG_CHECK(!plan.sequence_parallel || drop == nullptr || drop->p == 0 || taken.contains(module),
             "parallelize_module: ", path, " drops with p = ", drop ? drop->p : 0.0, " and no rule names it: under "
             "sequence parallelism a dropout on sequence shards needs a sequence_dropout rule (its mask is then the "
             "one-rank mask's rows); set its p to 0 if it drops something else");
  }
  ZG_CHECK(!plan.vocab_parallel_logits || dynamic_cast<nn::CausalLM*>(&model) != nullptr,
           "parallelize_module: vocab_parallel_logits needs a CausalLM, whose loss it computes from the shards");
  for (const auto& [name, p] : model.named_parameters()) {
    if (const ParameterOwner* owner = ParameterOwner::of(p))
      fail("parallelize_module: parameter '", name, "' already lives in ", owner->describe(),
           "; cut the model before building that");
  }
  return cuts;
}

// Where a cut's split is recorded: each module by path, and every name of every parameter.
struct ModelNames {
  std::unordered_map<std::string, nn::Module*> modules;
  nn::NamedTensors aliases;
  explicit ModelNames(nn::Module& model) : aliases(model.named_parameters(/*remove_duplicates=*/false)) {
    for (const auto& [path, module] : model.named_modules()) modules.emplace(path, module);
  }
};

// Cuts one parameter in place (every handle to it, a tied one's too, sees the slice) and
// records the split under each of its names.
void cut_parameter(const ModelNames& names, const Cut& cut, const std::string& local, const TensorSplit& split) {
  const Tensor target = parameter_of(cut, local);
  MemoryScope scope(MemoryCategory::parameter);
  target.set_data(slice_of(target.detach(), split));
  for (const auto& [name, p] : names.aliases) {
    if (!p.is_same(target)) continue;
    const size_t dot = name.rfind('.');
    const std::string owner = dot == std::string::npos ? "" : name.substr(0, dot);
    names.modules.at(owner)->set_split(dot == std::string::npos ? name : name.substr(dot + 1), split);
  }
}

// A parameter used on this rank's sequence shard gets a part of its gradient: the hook
// sums the ranks' parts as each is computed (before any data-parallel reduction of it).
void sum_gradient_over(const Tensor& param, const GroupRef& g) {
  param.register_hook([g](const Tensor& grad) {
    Tensor total = grad.contiguous().clone();
    g->all_reduce(total);
    return total;
  });
}

// The forward hooks that make the cut module compute its share of the whole one; with
// sequence parallelism (seq), the activations between the cut layers are sequence shards.
void add_collectives(const Cut& cut, ProcessGroup& group, bool seq) {
  const GroupRef g(group, kDestroyed);
  const ParallelRule& rule = *cut.rule;
  nn::Module& m = *cut.module;
  constexpr int64_t kSequence = 1;  // [B, S, C]
  switch (rule.style) {
    case ParallelStyle::colwise:
      if (rule.copy_input)
        m.register_forward_pre_hook([g, seq](nn::Module&, const Tensor& x) {
          return seq ? all_gather_sequence(x, *g, kSequence) : copy_to_group(x, *g);
        });
      if (rule.gather_output)
        m.register_forward_hook([g](nn::Module&, const Tensor&, const Tensor& y) { return gather_last_dim(y, *g); });
      break;
    case ParallelStyle::rowwise: {
      auto& linear = static_cast<nn::Linear&>(m);
      const Tensor bias = std::exchange(linear.bias, Tensor());  // still the module's parameter; added after the sum
      if (seq && bias.defined()) sum_gradient_over(bias, g);     // added to each rank's rows
      m.register_forward_hook([g, bias, seq](nn::Module&, const Tensor&, const Tensor& partial) {
        const Tensor y = seq ? reduce_scatter_sequence(partial, *g, kSequence) : reduce_from_group(partial, *g);
        return bias.defined() ? y + bias : y;
      });
      break;
    }
    case ParallelStyle::vocab_embedding: {
      auto& embedding = static_cast<nn::Embedding&>(m);
      embedding.first_id = g->rank() * embedding.weight.size(0);
      m.register_forward_hook([g](nn::Module&, const Tensor&, const Tensor& y) { return reduce_from_group(y, *g); });
      break;
    }
    case ParallelStyle::copy_output:
      if (seq)
        for (const Tensor& p : m.parameters()) sum_gradient_over(p, g);
      m.register_forward_hook([g, seq](nn::Module&, const Tensor&, const Tensor& y) {
        return seq ? all_gather_sequence(y, *g, kSequence) : copy_to_group(y, *g);
      });
      break;
    case ParallelStyle::sequence_norm:
      if (seq)
        for (const Tensor& p : m.parameters()) sum_gradient_over(p, g);
      break;
    case ParallelStyle::scatter_input:
      if (seq)
        m.register_forward_pre_hook([g](nn::Module&, const Tensor& x) { return scatter_to_sequence(x, *g, kSequence); });
      break;
    case ParallelStyle::sequence_dropout:
      if (seq) {
        auto& drop = static_cast<nn::Dropout&>(m);
        drop.part_dim = kSequence, drop.part = g->rank(), drop.parts = g->size();
      }
      break;
  }
}

}  // namespace

void parallelize_module(nn::Module& model, ProcessGroup& group, const nn::ParallelPlan& plan) {
  const std::vector<Cut> cuts = plan_cuts(model, plan, group.size(), group.rank());
  NoGradGuard no_grad;
  const ModelNames names(model);
  for (const Cut& cut : cuts) {
    for (const auto& [local, split] : cut.parameters) cut_parameter(names, cut, local, split);
    add_collectives(cut, group, plan.sequence_parallel);
  }
  if (plan.vocab_parallel_logits) {
    const GroupRef g(group, kDestroyed);
    dynamic_cast<nn::CausalLM&>(model).set_vocab_shards(
        {.cross_entropy = [g](const Tensor& logits, const Tensor& targets) {
           return vocab_parallel_cross_entropy(logits, targets, *g);
         },
         .gather = [g](const Tensor& logits) { return gather_last_dim(logits, *g); }});
  }
}

// Viewed as [.., chunks, block, ..] along split.dim: part `part` of `parts` of each block.
Tensor slice_of(const Tensor& whole, const TensorSplit& split) {
  ZG_CHECK(split.dim >= 0 && split.dim < whole.dim() && split.chunks >= 1 && split.parts >= 1 &&
               split.part >= 0 && split.part < split.parts && whole.size(split.dim) % (split.chunks * split.parts) == 0,
           "slice_of: part ", split.part, " of ", split.parts, " along dim ", split.dim, " in ", split.chunks,
           " chunks does not fit ", describe(whole));
  // A deferred model is cut without values: each slice draws its own (tensor/deferred.h).
  if (is_deferred(whole)) return deferred_slice(whole, split.dim, split.chunks, split.parts, split.part);
  Shape blocks = whole.shape();
  const int64_t d = split.dim, block = blocks[d] / split.chunks, n = block / split.parts;
  blocks[d] = block;
  blocks.insert(blocks.begin() + d, split.chunks);
  Shape shape = whole.shape();
  shape[d] = split.chunks * n;
  return whole.view(blocks).narrow(d + 1, split.part * n, n).reshape(shape).contiguous().clone();
}

// gathered [T, .., chunks * n, ..] -> [.., chunks, T, n, ..] -> [.., chunks T n, ..]: chunk c of
// the whole tensor is the ranks' chunk c pieces in rank order.
Tensor gather_split(const Tensor& slice, const TensorSplit& split, ProcessGroup& group) {
  const int world = group.size();
  ZG_CHECK(split.parts == world && split.dim >= 0 && split.dim < slice.dim() &&
               slice.size(split.dim) % split.chunks == 0,
           "gather_split: a split of ", split.parts, " parts along dim ", split.dim, " in ", split.chunks,
           " chunks does not fit ", describe(slice), " over a group of ", world);
  NoGradGuard no_grad;
  const Tensor mine = slice.contiguous();
  Shape gathered_shape = mine.shape();
  gathered_shape.insert(gathered_shape.begin(), world);
  Tensor gathered = empty(gathered_shape, TensorOptions(mine.dtype()).device(mine.device()));
  group.all_gather(mine.reshape({-1}), gathered.reshape({-1}));
  const int64_t d = split.dim, n = mine.size(d) / split.chunks;
  Shape blocks = gathered_shape;  // [T, .., chunks, n, ..]
  blocks[d + 1] = n;
  blocks.insert(blocks.begin() + d + 1, split.chunks);
  Shape order;  // T moved between chunks and n
  for (int64_t i = 1; i <= d + 1; ++i) order.push_back(i);
  order.push_back(0);
  for (int64_t i = d + 2; i < static_cast<int64_t>(blocks.size()); ++i) order.push_back(i);
  Shape whole = mine.shape();
  whole[d] *= world;
  return gathered.view(blocks).permute(order).reshape(whole);
}

void parallelize_module(nn::Module& model, ProcessGroup& group) { parallelize_module(model, group, model.parallel_plan()); }

}  // namespace zg::dist
