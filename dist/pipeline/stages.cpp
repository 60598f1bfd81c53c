#include "dist/pipeline/stages.h"

#include <algorithm>
#include <functional>
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

// `module` registered at dotted `path` below `root`, the plain containers on the way made
// ("transformer", "transformer.h"). A module already there stays if it holds the same
// parameters (the two ends of a tie, on one rank); another is an error.
void register_at(nn::Module& root, const std::string& path, const std::shared_ptr<nn::Module>& module, const char* who) {
  nn::Module* at = &root;
  size_t begin = 0;
  for (size_t dot; (dot = path.find('.', begin)) != std::string::npos; begin = dot + 1) {
    const std::string name = path.substr(begin, dot - begin);
    std::shared_ptr<nn::Module> next = child_of(*at, name);
    if (!next) next = at->register_module(name, std::make_shared<nn::Module>());
    ZG_CHECK(is_container(*next), who, ": '", path.substr(0, dot), "' is a container in one chunk and a layer in another");
    at = next.get();
  }
  const std::string name = path.substr(begin);
  const std::shared_ptr<nn::Module> have = child_of(*at, name);
  if (!have) at->register_module(name, module);
  else ZG_CHECK(have == module || same_parameters(*have, *module), who, ": two chunks hold different modules named '",
                path, "'");
}

// Every module below `from` that is not a container, registered in `into` at its path.
void join_leaves(nn::Module& into, const nn::Module& from, const std::string& prefix) {
  for (const auto& [name, c] : from.named_children())
    if (is_container(*c)) join_leaves(into, *c, prefix + name + ".");
    else register_at(into, prefix + name, c, "join_chunks");
}

std::shared_ptr<nn::Module> find(const std::vector<std::pair<std::string, std::shared_ptr<nn::Module>>>& named,
                                 const std::string& path) {
  for (const auto& [p, m] : named)
    if (p == path) return m;
  return nullptr;
}

using Named = std::vector<std::pair<std::string, std::shared_ptr<nn::Module>>>;  // by the model's paths

// A causal LM as the stages see it: embeddings, blocks, final modules, each by its path.
struct LanguageModel {
  Named embeds, blocks, finals;  // finals: the last norm (and an untied head)
  std::string tied;              // the embedding whose weight the head reads; empty: untied
  std::function<Tensor(const Tensor&)> embed;                          // ids -> hidden states
  std::function<Tensor(const Tensor&, nn::Module* tied_head)> head;   // hidden -> logits
  std::function<void()> prepare;                                       // before each stage's forward
  bool checkpoint_blocks = false;
  nn::UnitPlan whole;  // the model's own plan: a stage that is the whole model
};

// Stage: blocks [first, end), with the embeddings before them on the first stage and the
// final modules and the head after them on the last -- the model's forward, cut. Its
// modules keep the model's paths; apart from the first stage, a tied head holds the
// embedding's weight under the embedding's own path, so checkpoints and consolidated
// states name it as the whole model does, at any cut.
class LanguageModelStage final : public nn::Module {
 public:
  LanguageModelStage(const LanguageModel& model, size_t first, size_t end, bool embeds, bool heads)
      : model_(model), embeds_(embeds), heads_(heads) {
    if (embeds_)
      for (const auto& [path, m] : model.embeds) register_at(*this, path, m, "stages");
    for (size_t i = first; i < end; ++i) {
      register_at(*this, model.blocks[i].first, model.blocks[i].second, "stages");
      blocks_.push_back(model.blocks[i]);
    }
    if (!heads_) return;
    for (const auto& [path, m] : model.finals) register_at(*this, path, m, "stages");
    if (model.tied.empty()) return;
    const nn::Module& embedding = *find(model.embeds, model.tied);
    const auto head = std::make_shared<TiedHead>(embedding.named_parameters().front().second);
    for (const auto& [name, split] : embedding.named_splits())  // cut by tp: the head holds the same slice
      head->set_split(name, split);
    tied_head_ = head;
    register_at(*this, embeds_ ? "lm_head" : model.tied, head, "stages");
  }

  nn::UnitPlan unit_plan() const override {
    if (embeds_ && heads_) return model_.whole;
    nn::UnitPlan plan;
    if (embeds_) {
      for (const auto& [path, m] : model_.embeds)
        (path == model_.tied ? plan.units : plan.root_before).push_back(path);
      if (!model_.tied.empty()) plan.tied.push_back(model_.tied);
      for (const auto& [path, m] : model_.embeds) plan.backward_reads_no_weights.push_back(path);  // a scatter-add
    }
    for (const auto& [path, m] : blocks_) plan.units.push_back(path);
    if (heads_) {
      // Uses run in the plan's order, root_after's last: before a tied head the final norm
      // is a unit of its own (ZeRO-3 would otherwise gather the head, then the norm, then
      // the head again).
      for (const auto& [path, m] : model_.finals) (model_.tied.empty() ? plan.root_after : plan.units).push_back(path);
      if (!model_.tied.empty()) plan.units.push_back(model_.tied), plan.tied.push_back(model_.tied);
    }
    return plan;
  }
  // The final modules unit_plan() makes units of, to run before a tied head.
  std::vector<std::string> finals_before_tie() const {
    std::vector<std::string> out;
    if (heads_ && !embeds_ && !model_.tied.empty())
      for (const auto& [path, m] : model_.finals) out.push_back(path);
    return out;
  }

  Tensor forward(const Tensor& input) override {
    if (model_.prepare) model_.prepare();
    Tensor x = embeds_ ? model_.embed(input) : input;
    for (const auto& [path, block] : blocks_) {
      nn::Module& b = *block;
      x = model_.checkpoint_blocks ? nn::checkpoint([&b](const std::vector<Tensor>& in) { return b(in[0]); }, {x})
                                   : b(x);
    }
    return heads_ ? model_.head(x, tied_head_.get()) : x;
  }

 private:
  LanguageModel model_;
  bool embeds_, heads_;
  Named blocks_;
  std::shared_ptr<nn::Module> tied_head_;
};

// The model cut into `stages` stages, its blocks spread evenly (the first blocks % S stages one more).
Stages cut(const char* who, const LanguageModel& model, int stages, nn::CausalLM& whole) {
  const auto blocks = static_cast<int64_t>(model.blocks.size());
  ZG_CHECK(stages >= 1 && stages <= blocks, who, ": ", stages, " stages for a model of ", blocks,
           " layers; each stage needs at least one block");
  Stages out;
  for (int64_t s = 0, first = 0; s < stages; ++s) {
    const int64_t end = first + blocks / stages + (s < blocks % stages ? 1 : 0);
    out.modules.push_back(std::make_shared<LanguageModelStage>(model, static_cast<size_t>(first),
                                                               static_cast<size_t>(end), s == 0, s == stages - 1));
    first = end;
  }
  if (stages > 1 && !model.tied.empty())
    out.tied.push_back(find(model.embeds, model.tied)->named_parameters().front().second);
  out.loss = [&whole](const Tensor& logits, const Tensor& targets) { return whole.loss(logits, targets); };
  return out;
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
      join_leaves(*this, *chunk, "");
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
        // The head's stage made its final norm a unit only to run before the tied head; untied,
        // the norm is the root's again, its last use, so the root stays gathered through the head.
        for (const auto& c : chunks)
          if (const auto* stage = dynamic_cast<const LanguageModelStage*>(c.get()))
            for (const std::string& path : stage->finals_before_tie()) {
              for (auto* list : {&p.units, &plan_.units}) std::erase(*list, path);
              p.root_after.push_back(path);
            }
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
  LanguageModel lm;
  lm.embeds = {{"transformer.wte", model.wte}, {"transformer.wpe", model.wpe}};
  for (size_t i = 0; i < model.h->size(); ++i)
    lm.blocks.emplace_back("transformer.h." + std::to_string(i), model.h->ptr<nn::Module>(i));
  lm.finals = {{"transformer.ln_f", model.ln_f}};
  lm.tied = "transformer.wte";
  lm.embed = [&model](const Tensor& idx) { return model.embed(idx); };  // GPT::logits' first line
  const std::shared_ptr<nn::Module> ln_f = model.ln_f;
  lm.head = [ln_f](const Tensor& x, nn::Module* tied_head) { return (*tied_head)((*ln_f)(x)); };
  lm.checkpoint_blocks = model.config.activation_checkpointing;
  lm.whole = model.unit_plan();
  return cut("gpt_stages", lm, stages, model);
}

Stages llama_stages(nn::Llama& model, int stages) {
  LanguageModel lm;
  lm.embeds = {{"model.embed_tokens", model.embed_tokens}};
  for (size_t i = 0; i < model.layers->size(); ++i)
    lm.blocks.emplace_back("model.layers." + std::to_string(i), model.layers->ptr<nn::Module>(i));
  lm.finals = {{"model.norm", model.norm}};
  if (model.lm_head) lm.finals.emplace_back("lm_head", model.lm_head);
  else lm.tied = "model.embed_tokens";
  lm.embed = [&model](const Tensor& idx) { return (*model.embed_tokens)(idx); };
  const std::shared_ptr<nn::Module> norm = model.norm, lm_head = model.lm_head;
  lm.head = [norm, lm_head](const Tensor& x, nn::Module* tied_head) {
    return (lm_head ? *lm_head : *tied_head)((*norm)(x));
  };
  lm.prepare = [&model] { model.set_position_offset(0); };  // positions from 0: no cache in training
  lm.checkpoint_blocks = model.config.activation_checkpointing;
  lm.whole = model.unit_plan();
  return cut("llama_stages", lm, stages, model);
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
