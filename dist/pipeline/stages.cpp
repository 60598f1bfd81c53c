#include "dist/pipeline/stages.h"

#include <algorithm>
#include <map>
#include <typeinfo>

#include "autograd/functions.h"
#include "nn/checkpoint.h"

namespace zg::dist {

namespace {

// The LM head tied to the token embedding: logits = x wte^T. A module of its own, so that
// ZeRO-3 gathers its weight around its forward, as any unit's.
class TiedHead final : public nn::Module {
 public:
  explicit TiedHead(const Tensor& wte) { register_parameter("weight", wte); }
  Tensor forward(const Tensor& x) override {
    const Tensor w = named_parameters().front().second;
    return matmul(x.reshape({-1, x.size(-1)}), w, false, true).view({x.size(0), x.size(1), w.size(0)});
  }
};

// Blocks [first, end) of a GPT, with the embeddings before them on the first stage and
// ln_f and the head after them on the last -- GPT::logits, cut. Its parameters keep the
// model's names (transformer.h.2.attn.c_attn.weight, ...).
class GPTStage final : public nn::Module {
 public:
  GPTStage(nn::GPT& model, int64_t first, int64_t end, bool embeds, bool heads)
      : model_(model), first_(first), end_(end), embeds_(embeds), heads_(heads) {
    const auto transformer = register_module("transformer", std::make_shared<nn::Module>());
    if (embeds_) transformer->register_module("wte", model.wte), transformer->register_module("wpe", model.wpe);
    const auto h = transformer->register_module("h", std::make_shared<nn::Module>());
    for (int64_t i = first; i < end; ++i)
      blocks_.push_back(h->register_module(std::to_string(i), model.h->ptr<nn::Module>(static_cast<size_t>(i))));
    if (heads_) {
      transformer->register_module("ln_f", model.ln_f);
      // Apart from the first stage, the head holds wte under wte's name: checkpoints and
      // consolidated states name it as the whole model does, at any cut.
      const auto head = std::make_shared<TiedHead>(model.wte->weight);
      head_ = embeds_ ? register_module("lm_head", head) : transformer->register_module("wte", head);
      for (const auto& [name, split] : model.wte->named_splits())  // cut by tp: the head holds wte's slice
        if (name == "weight") head_->set_split("weight", split);
    }
  }

  nn::UnitPlan unit_plan() const override {
    if (embeds_ && heads_) return model_.unit_plan();  // the whole model: one stage
    nn::UnitPlan plan;
    if (embeds_) {
      plan.units = plan.tied = {"transformer.wte"};
      plan.root_before = {"transformer.wpe"};
      plan.backward_reads_no_weights = {"transformer.wte", "transformer.wpe"};  // embeddings: a scatter-add
    }
    for (int64_t i = first_; i < end_; ++i) plan.units.push_back("transformer.h." + std::to_string(i));
    if (heads_) {
      plan.units.push_back("transformer.wte"), plan.tied.push_back("transformer.wte");
      plan.root_after = {"transformer.ln_f"};
    }
    return plan;
  }

  Tensor forward(const Tensor& input) override {
    const nn::GPTConfig& config = model_.config;
    Tensor x = input;
    if (embeds_) {
      const Tensor positions = arange(0.0, static_cast<double>(input.size(1)), 1.0,
                                      TensorOptions(DType::i64).device(input.device()));
      x = dropout((*model_.wte)(input) + (*model_.wpe)(positions), config.dropout, is_training());
    }
    for (const auto& block : blocks_) {
      nn::Module& b = *block;
      x = config.activation_checkpointing ? nn::checkpoint([&b](const std::vector<Tensor>& in) { return b(in[0]); }, {x})
                                          : b(x);
    }
    return heads_ ? (*head_)((*model_.ln_f)(x)) : x;
  }

 private:
  nn::GPT& model_;
  int64_t first_, end_;
  bool embeds_, heads_;
  std::vector<std::shared_ptr<nn::Module>> blocks_;
  std::shared_ptr<nn::Module> head_;
};

// A module that only groups others (a GPT's "transformer"): a plain nn::Module with no
// parameter or buffer of its own.
bool is_container(const nn::Module& m) {
  if (typeid(m) != typeid(nn::Module)) return false;
  for (const nn::NamedTensors& named : {m.named_parameters(false), m.named_buffers()})
    for (const auto& [name, t] : named)
      if (name.find('.') == std::string::npos) return false;
  return true;
}

bool same_parameters(const nn::Module& a, const nn::Module& b) {
  const nn::NamedTensors x = a.named_parameters(), y = b.named_parameters();
  return x.size() == y.size() && std::equal(x.begin(), x.end(), y.begin(), [](const auto& p, const auto& q) {
           return p.first == q.first && p.second.is_same(q.second);
         });
}

std::shared_ptr<nn::Module> child_of(const nn::Module& m, const std::string& name) {
  for (const auto& [n, c] : m.named_children())
    if (n == name) return c;
  return nullptr;
}

// `from`'s submodules registered in `into`; a container both have is joined into a new one.
void join(nn::Module& into, const nn::Module& from, const std::string& path) {
  for (const auto& [name, c] : from.named_children()) {
    std::shared_ptr<nn::Module> have = child_of(into, name);
    const std::string at = path + name;
    if (is_container(*c)) {
      if (!have) have = into.register_module(name, std::make_shared<nn::Module>());
      ZG_CHECK(is_container(*have), "join_chunks: '", at, "' is a container in one chunk and a layer in another");
      join(*have, *c, at + ".");
    } else if (have != c) {
      ZG_CHECK(have == nullptr || same_parameters(*have, *c), "join_chunks: two chunks hold different modules named '",
               at, "'");
      if (!have) into.register_module(name, c);  // (else a tie's two ends, both here: one module holds it)
    }
  }
}

class JoinedChunks final : public nn::Module {
 public:
  explicit JoinedChunks(const std::vector<std::shared_ptr<nn::Module>>& chunks) {
    std::map<const TensorImpl*, std::string> tied_here;  // a tied unit's weight: the unit
    for (const auto& chunk : chunks) {
      ZG_CHECK(chunk != nullptr, "join_chunks: a chunk is null");
      for (const auto& [name, p] : chunk->named_parameters())
        ZG_CHECK(name.find('.') != std::string::npos, "join_chunks: a chunk holds parameter '", name,
                 "' itself; chunks are joined by their submodules, so hold it in one");
      join(*this, *chunk, "");
      nn::UnitPlan p = chunk->unit_plan();
      for (const std::string& tie : std::vector<std::string>(p.tied)) {
        const Tensor weight = tied_weight(*chunk, tie);
        const auto other = tied_here.find(&weight.impl());
        if (other == tied_here.end()) {
          tied_here.emplace(&weight.impl(), tie);
          continue;
        }
        // Both ends here: no tie, and no unit of its own -- the weight joins the root, which
        // ZeRO-3 gathers from the embedding's forward and keeps through the head's (GPT's plan).
        for (auto* list : {&p.units, &p.tied, &plan_.units, &plan_.tied}) std::erase(*list, tie), std::erase(*list, other->second);
        if (std::ranges::find(plan_.root_before, other->second) == plan_.root_before.end())
          plan_.root_before.push_back(other->second);
      }
      for (auto [to, from] : {std::pair{&plan_.units, &p.units}, {&plan_.root_before, &p.root_before},
                              {&plan_.root_after, &p.root_after}, {&plan_.tied, &p.tied},
                              {&plan_.backward_reads_no_weights, &p.backward_reads_no_weights}})
        to->insert(to->end(), from->begin(), from->end());
    }
  }
  nn::UnitPlan unit_plan() const override { return plan_; }
  Tensor forward(const Tensor&) override {
    fail("join_chunks: the joined chunks are not run as one module; a dist::Pipeline runs each chunk");
  }

 private:
  // The one weight of tied unit `path` of `chunk`.
  static Tensor tied_weight(nn::Module& chunk, const std::string& path) {
    for (const auto& [name, m] : chunk.named_modules())
      if (name == path) {
        const nn::NamedTensors params = m->named_parameters();
        ZG_CHECK(params.size() == 1, "join_chunks: tied unit '", path, "' holds ", params.size(),
                 " parameters; a tied unit holds its tied weight alone");
        return params.front().second;
      }
    fail("join_chunks: the plan ties '", path, "', which the chunk does not have");
  }

  nn::UnitPlan plan_;
};

}  // namespace

Stages gpt_stages(nn::GPT& model, int stages) {
  const int64_t layers = model.config.n_layer;
  ZG_CHECK(stages >= 1 && stages <= layers, "gpt_stages: ", stages, " stages for a GPT of ", layers,
           " layers; each stage needs at least one block");
  Stages out;
  for (int64_t s = 0, first = 0; s < stages; ++s) {
    const int64_t end = first + layers / stages + (s < layers % stages ? 1 : 0);
    out.modules.push_back(std::make_shared<GPTStage>(model, first, end, s == 0, s == stages - 1));
    first = end;
  }
  if (stages > 1) out.tied.push_back(model.wte->weight);
  out.loss = [&model](const Tensor& logits, const Tensor& targets) { return model.loss(logits, targets); };
  return out;
}

std::vector<std::shared_ptr<nn::Module>> Stages::chunks(const Schedule& schedule, int rank) const {
  ZG_CHECK(static_cast<int>(modules.size()) == schedule.stages(), "Stages::chunks: the ", name(schedule.kind),
           " schedule runs ", schedule.stages(), " stages (", schedule.ranks, " ranks x ", schedule.chunks,
           " chunks), the model was cut into ", modules.size());
  ZG_CHECK(rank >= 0 && rank < schedule.ranks, "Stages::chunks: rank ", rank, " of a pipeline of ", schedule.ranks);
  std::vector<std::shared_ptr<nn::Module>> out;
  for (int c = 0; c < schedule.chunks; ++c) out.push_back(modules[static_cast<size_t>(schedule.stage(rank, c))]);
  return out;
}

std::shared_ptr<nn::Module> join_chunks(const std::vector<std::shared_ptr<nn::Module>>& chunks) {
  return std::make_shared<JoinedChunks>(chunks);
}


}  // namespace zg::dist
