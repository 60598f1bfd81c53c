#include "dist/pipeline/messages.h"

#include <algorithm>
#include <map>
#include <utility>

#include "tensor/tensor.h"

namespace zg::dist {

std::string Message::str() const {
  return "micro-batch " + std::to_string(micro_batch) + "'s " + (gradient ? "gradient" : "activation") +
         " from stage " + std::to_string(from()) + " to " + std::to_string(to());
}

namespace {

// The message action `a` of rank r waits for from another rank: F's input, B's or I's
// output gradient.
std::optional<Message> received_by(const Schedule& s, int r, const Action& a) {
  const int stage = s.stage(r, a.chunk);
  if (a.kind == Action::forward && stage > 0 && s.rank_of(stage - 1) != r) return Message{a.micro_batch, stage - 1, false};
  const bool backward = a.kind == Action::backward || a.kind == Action::backward_input;
  if (backward && stage < s.stages() - 1 && s.rank_of(stage + 1) != r) return Message{a.micro_batch, stage, true};
  return std::nullopt;
}

// The message action `a` of rank r sends another rank: F's output, B's or I's input gradient.
std::optional<Message> sent_by(const Schedule& s, int r, const Action& a) {
  const int stage = s.stage(r, a.chunk);
  if (a.kind == Action::forward && stage < s.stages() - 1 && s.rank_of(stage + 1) != r)
    return Message{a.micro_batch, stage, false};
  const bool backward = a.kind == Action::backward || a.kind == Action::backward_input;
  if (backward && stage > 0 && s.rank_of(stage - 1) != r) return Message{a.micro_batch, stage - 1, true};
  return std::nullopt;
}

// A rank that cannot go on: at its exchange `step`, waiting for the other end of `message`.
struct Stuck {
  int rank = 0;
  size_t step = 0;
  Message message;
  bool sending = false;
};

// Runs the plan with every exchange a rendezvous: a rank waits at an exchange until each
// of its messages' other end has been posted. An exchange that receives a header first
// takes it alone (the shape to receive into is not known before), and only then posts
// the rest -- the executor's order. Returns the ranks left stuck when a round moves none:
// none if the plan finishes.
std::vector<Stuck> run_rendezvous(const Schedule& s, const std::vector<std::vector<PlanStep>>& plan) {
  std::vector<std::map<int64_t, size_t>> posted_at(s.ranks);  // per rank: message tag -> its step
  for (int r = 0; r < s.ranks; ++r)
    for (size_t k = 0; k < plan[r].size(); ++k)
      if (const auto* e = std::get_if<Exchange>(&plan[r][k])) {
        for (const Message& m : e->sends) posted_at[r][m.tag(s.stages())] = k;
        if (e->receive) posted_at[r][e->receive->tag(s.stages())] = k;
      }
  std::vector<size_t> at(s.ranks, 0);
  std::vector<bool> header_in(s.ranks, false);  // at an exchange that receives an activation: its header came
  const auto takes_header = [](const Exchange& e) { return e.receive && e.receive->carries_header(); };
  // Whether the rank of `stage` has posted its end of m.
  const auto posted = [&](const Message& m, int stage) {
    const int peer = s.rank_of(stage);
    const size_t k = posted_at[peer].at(m.tag(s.stages()));
    return at[peer] > k || (at[peer] == k && (header_in[peer] || !takes_header(std::get<Exchange>(plan[peer][k]))));
  };
  // The first of rank r's exchange's messages whose other end is not posted yet.
  const auto waiting_on = [&](int r, const Exchange& e) -> std::optional<Stuck> {
    if (takes_header(e) && !header_in[r]) {
      if (!posted(*e.receive, e.receive->from())) return Stuck{r, at[r], *e.receive, false};
      header_in[r] = true;
    }
    for (const Message& m : e.sends)
      if (!posted(m, m.to())) return Stuck{r, at[r], m, true};
    if (e.receive && !posted(*e.receive, e.receive->from())) return Stuck{r, at[r], *e.receive, false};
    return std::nullopt;
  };
  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < s.ranks; ++r)
      for (; at[r] < plan[r].size(); ++at[r], header_in[r] = false, moved = true) {
        const auto* e = std::get_if<Exchange>(&plan[r][at[r]]);
        const bool had_header = header_in[r];
        if (e && waiting_on(r, *e)) {
          moved = moved || header_in[r] != had_header;
          break;
        }
      }
  }
  std::vector<Stuck> stuck;
  for (int r = 0; r < s.ranks; ++r)
    if (at[r] < plan[r].size()) stuck.push_back(*waiting_on(r, std::get<Exchange>(plan[r][at[r]])));
  return stuck;
}

// Moves a send from rank r's exchange `step` to its next exchange (a new one at the end if
// none), behind the sends made before it; an exchange left empty goes.
void delay_send(std::vector<PlanStep>& steps, size_t step, const Message& m, const std::map<int64_t, size_t>& made_at,
                int stages) {
  auto& from = std::get<Exchange>(steps[step]).sends;
  std::erase(from, m);
  size_t next = step + 1;
  while (next < steps.size() && !std::holds_alternative<Exchange>(steps[next])) ++next;
  if (next == steps.size()) steps.push_back(Exchange{});
  auto& to = std::get<Exchange>(steps[next]).sends;
  to.insert(std::find_if(to.begin(), to.end(), [&](const Message& x) {
              return made_at.at(x.tag(stages)) > made_at.at(m.tag(stages));
            }),
            m);
  if (const auto& e = std::get<Exchange>(steps[step]); e.sends.empty() && !e.receive)
    steps.erase(steps.begin() + static_cast<std::ptrdiff_t>(step));
}

// Messages from one rank to another pair in the order posted (NCCL, and the groups' tags):
// the sender's order must be the receiver's.
void check_channel_order(const Schedule& s, const std::vector<std::vector<PlanStep>>& plan) {
  std::map<std::pair<int, int>, std::vector<Message>> sent, received;  // by (from rank, to rank)
  for (int r = 0; r < s.ranks; ++r)
    for (const PlanStep& step : plan[r])
      if (const auto* e = std::get_if<Exchange>(&step)) {
        for (const Message& m : e->sends) sent[{r, s.rank_of(m.to())}].push_back(m);
        if (e->receive) received[{s.rank_of(e->receive->from()), r}].push_back(*e->receive);
      }
  for (const auto& [channel, messages] : sent)
    for (size_t i = 0; i < messages.size(); ++i)
      ZG_CHECK(received[channel][i] == messages[i], "pipeline: in ", s.describe(), ", rank ", channel.first,
               " sends rank ", channel.second, " ", messages[i].str(), " where that rank receives ",
               received[channel][i].str(), ": the two orders differ");
}

}  // namespace

std::vector<std::vector<PlanStep>> message_plan(const Schedule& s) {
  simulate(s);  // every action once, in an order that can finish when sends need not wait
  std::vector<std::vector<PlanStep>> plan(s.ranks);
  std::vector<std::map<int64_t, size_t>> made_at(s.ranks);  // per rank: a send's tag -> the action that makes it
  for (int r = 0; r < s.ranks; ++r) {
    const std::vector<Action>& actions = s.actions[r];
    std::vector<Message> pending;  // sent by the last actions, not posted yet
    for (size_t k = 0; k < actions.size(); ++k) {
      if (const auto receive = received_by(s, r, actions[k])) plan[r].push_back(Exchange{std::exchange(pending, {}), receive});
      plan[r].push_back(actions[k]);
      if (const auto send = sent_by(s, r, actions[k])) pending.push_back(*send), made_at[r][send->tag(s.stages())] = k;
      const bool receives_next = k + 1 < actions.size() && received_by(s, r, actions[k + 1]);
      if (!pending.empty() && !receives_next) plan[r].push_back(Exchange{std::exchange(pending, {}), std::nullopt});
    }
  }
  check_channel_order(s, plan);
  // Where ranks would wait on each other's sends, a send waits for a later exchange
  // (interleaving and ZB-H2 need some); each move is later, so this ends.
  for (std::vector<Stuck> stuck = run_rendezvous(s, plan); !stuck.empty(); stuck = run_rendezvous(s, plan)) {
    // A send posted alone first: it joins the next receive, as Megatron's paired calls.
    const auto alone = [&](const Stuck& x) { return x.sending && !std::get<Exchange>(plan[x.rank][x.step]).receive; };
    auto send = std::find_if(stuck.begin(), stuck.end(), alone);
    if (send == stuck.end()) send = std::find_if(stuck.begin(), stuck.end(), [](const Stuck& x) { return x.sending; });
    if (send != stuck.end()) {
      delay_send(plan[send->rank], send->step, send->message, made_at[send->rank], s.stages());
      continue;
    }
    std::string ranks;
    for (const Stuck& x : stuck)
      ranks += (ranks.empty() ? "" : "; ") + ("rank " + std::to_string(x.rank) + " waits on " + x.message.str());
    ZG_CHECK(false, "pipeline: ", s.describe(), " would deadlock where a send waits for its receive (NCCL): ", ranks);
  }
  return plan;
}

}  // namespace zg::dist
