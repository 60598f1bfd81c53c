// Point-to-point messages of the local group: each waits in the hub's channel for its
// (sender, receiver) pair until its partner is posted; whichever rank posts second pairs
// the two, compares them and copies the bytes (local_group.h).
#include "dist/comm/local_group.h"

#include "tensor/backend.h"

namespace zg::dist {

struct LocalHub::Message {
  Collective call;  // while unpaired or copying: holds the buffer's bytes
  int rank = 0, peer = 0;
  int64_t index = 0;  // its place among its channel's sends (or receives)
  std::string what;   // "send(f32[4] on cpu, to rank 1, tag 3)"
  bool paired = false, done = false;
  std::string error;  // how it failed, once done
};

class LocalHub::MessageWork final : public Work {
 public:
  MessageWork(std::shared_ptr<LocalHub> hub, std::shared_ptr<Message> message)
      : hub_(std::move(hub)), message_(std::move(message)) {}
  void wait() override { hub_->wait(*message_); }
  bool completed() const override {
    std::lock_guard lock(hub_->mutex_);
    return message_->done;
  }

 private:
  std::shared_ptr<LocalHub> hub_;
  std::shared_ptr<Message> message_;
};

// The send's bytes are complete on its device when posted (its stream synchronized), so
// whichever rank pairs the two can copy them at once.
WorkHandle LocalHub::post(int rank, const Collective& call) {
  const bool sending = call.op == CollectiveOp::send;
  const int src = sending ? rank : call.root, dst = sending ? call.root : rank;
  if (sending) backend(call.input.device()).synchronize(call.input.device());
  auto message = std::make_shared<Message>();
  message->call = call, message->rank = rank, message->peer = call.root, message->what = call.describe();
  std::pair<std::shared_ptr<Message>, std::shared_ptr<Message>> pair;
  {
    std::lock_guard lock(mutex_);
    ZG_CHECK(!aborted_, "local group: rank ", rank, " cannot post ", message->what, ": ", abort_reason_);
    Channel& channel = channels_[{src, dst}];
    auto& side = sending ? channel.sends : channel.recvs;
    message->index = channel.paired + static_cast<int64_t>(side.size());
    side.push_back(message);
    if (!channel.sends.empty() && !channel.recvs.empty()) pair = pair_locked(channel, src, dst);
  }
  if (const auto& [send, recv] = pair; send) {
    std::string error;
    try {
      const Tensor& to = recv->call.output;
      backend(to.device()).copy(send->call.input.view({to.numel()}), to.view({to.numel()}));
      backend(to.device()).synchronize(to.device());
    } catch (const std::exception& e) {
      error = "local group: copying message #" + std::to_string(send->index) + " from rank " + std::to_string(src) +
              " to rank " + std::to_string(dst) + " failed: " + e.what();
    }
    std::lock_guard lock(mutex_);
    for (Message* m : {send.get(), recv.get()}) m->done = true, m->error = error, m->call = Collective{};
    cv_.notify_all();
  }
  return std::make_shared<MessageWork>(shared_from_this(), message);
}

std::pair<std::shared_ptr<LocalHub::Message>, std::shared_ptr<LocalHub::Message>> LocalHub::pair_locked(
    Channel& channel, int src, int dst) {
  std::shared_ptr<Message> send = channel.sends.front(), recv = channel.recvs.front();
  channel.sends.pop_front();
  channel.recvs.pop_front();
  const std::string problem = Collective::p2p_mismatch(send->call.signature(), recv->call.signature(), src, dst,
                                                       channel.paired++, "local group");
  if (problem.empty()) {
    send->paired = recv->paired = true;
    return {send, recv};
  }
  for (Message* m : {send.get(), recv.get()}) m->done = true, m->error = problem, m->call = Collective{};
  cv_.notify_all();
  return {};
}

// A paired message is being copied: it ends promptly whatever happens to the group.
void LocalHub::wait(Message& m) {
  std::unique_lock lock(mutex_);
  const auto gone = [&] { return !m.paired && departed_[m.peer]; };
  cv_.wait_for(lock, timeout_, [&] { return m.done || (!m.paired && aborted_) || gone(); });
  if (m.done) {
    if (!m.error.empty()) throw Error(m.error);
    return;
  }
  const std::string what = "local group: rank " + std::to_string(m.rank) + "'s " + m.what + " (message #" +
                           std::to_string(m.index) + ")";
  const std::string partner = m.call.op == CollectiveOp::send ? "receive" : "send";
  if (m.paired) throw Error(what + " did not finish copying within " + std::to_string(timeout_.count()) + " ms");
  if (aborted_) throw Error(what + ": " + abort_reason_);
  if (gone())
    throw Error(what + " waits for rank " + std::to_string(m.peer) +
                ", which returned from its function without posting the matching " + partner);
  throw Error(what + " timed out after " + std::to_string(timeout_.count()) + " ms: rank " + std::to_string(m.peer) +
              " has not posted the matching " + partner);
}

std::vector<WorkHandle> LocalGroup::issue_p2p(std::vector<Collective> messages) {
  std::vector<WorkHandle> works;
  for (const Collective& m : messages) works.push_back(hub_->post(rank_, m));
  return works;
}

}  // namespace zg::dist
