// The `local` process group: N ranks as N threads of one process. Each rank has
// its own Context (allocator figures, Philox state); collectives meet in a shared
// LocalHub and move data through shared memory.
//
// A collective is two rendezvous: at the first, every rank has posted what it is
// calling, and the calls are compared -- a different op, dtype or size on any rank
// fails every rank with a message naming both calls, instead of hanging. Between
// the two, each rank reads the others' buffers and computes its result; after the
// second, it writes its own buffer, once nobody reads it any more.
//
// Point-to-point messages wait in the hub's channel for their (sender, receiver) pair
// until their partner is posted; whichever comes second pairs them, compares them and
// copies the bytes.
//
// Nothing waits forever: a rank that fails aborts the hub, which wakes the others
// with that rank's error; a rank that returns while others wait for it fails them at
// once; and every wait gives up after the configured timeout.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dist/comm/process_group.h"

namespace zg::dist {

class LocalHub : public std::enable_shared_from_this<LocalHub> {
 public:
  LocalHub(int size, std::chrono::milliseconds timeout);
  int size() const { return size_; }
  // Marks the group failed; ranks inside or entering a collective throw with `reason`.
  void abort(int rank, const std::string& reason);

  // First rendezvous: posts what this rank calls, waits for every rank, checks that
  // the calls match. The posted call holds handles (not pointers) to the buffers: if
  // this rank unwinds after an abort while another is still reading, the bytes stay
  // alive. A completed collective drops them.
  void enter(int rank, const Collective& call);
  const Collective& call_of(int rank) const { return posted_[rank]; }
  // Second rendezvous; then this rank's call (and its buffer handles) is dropped.
  void leave(int rank);
  // This rank has returned from its function: a rank still waiting for it fails at once.
  void depart(int rank);
  // Why the group failed, or "" -- also where no rank saw it: a collective issued
  // asynchronously and never waited for.
  std::string failure();
  // The hub of a sub-group (ProcessGroup::split): `members`, ranks of this hub, formed by
  // its `split`-th split. The first member to ask makes it, the others find it. It fails
  // with this hub: an abort here aborts it, a rank departing here departs it.
  std::shared_ptr<LocalHub> child(int64_t split, const std::vector<int>& members);

  // Posts rank `rank`'s send or recv (peer in message.root); its Work completes once the
  // partner is posted and the bytes are copied, and fails on a mismatch, an abort, a peer
  // that returned without posting it, or the timeout.
  WorkHandle post(int rank, const Collective& message);

 private:
  struct Message;  // a posted send or receive, and how it ended (local_group.cpp)
  class MessageWork;
  struct Channel {  // the messages from one rank to another not yet paired, oldest first
    std::deque<std::shared_ptr<Message>> sends, recvs;
    int64_t paired = 0;
  };
  // Pairs the channel's oldest send and receive (both there), under the lock; returns the
  // pair to copy, or {} if they did not match (both then failed).
  std::pair<std::shared_ptr<Message>, std::shared_ptr<Message>> pair_locked(Channel& channel, int src, int dst);
  void wait(Message& message);  // MessageWork::wait()'s work
  // Waits until every rank arrives. The last to arrive runs `check` (all others are
  // blocked, so every posted call is alive); a non-empty result fails every rank with it.
  void rendezvous(int rank, const std::string& where, const std::function<std::string()>& check = nullptr);
  [[noreturn]] void fail_locked(const std::string& message);
  void abort_with(const std::string& reason);  // abort()'s work, the reason as given

  struct Child {
    int64_t split;
    std::vector<int> members;
    std::shared_ptr<LocalHub> hub;
  };

  const int size_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Collective> posted_;
  std::vector<int64_t> calls_made_;  // per rank: collectives entered so far
  std::vector<bool> departed_;       // per rank: returned from its function
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string abort_reason_;
  std::string mismatch_;  // set when calls did not match: thrown as is by every rank
  std::vector<Child> children_;
  std::map<std::pair<int, int>, Channel> channels_;  // by (sender, receiver)
};

class LocalGroup final : public HostGroup {
 public:
  LocalGroup(std::shared_ptr<LocalHub> hub, int rank) : hub_(std::move(hub)), rank_(rank) {}
  ~LocalGroup() override { stop_worker(); }
  int rank() const override { return rank_; }
  int size() const override { return hub_->size(); }
  std::string kind() const override { return "local"; }
  bool accepts(Device) const override { return true; }

 private:
  void run(const Collective& collective) override;
  void exchange(const Collective& collective);  // run()'s work, without the abort on failure
  std::vector<WorkHandle> issue_p2p(std::vector<Collective> messages) override;
  std::unique_ptr<ProcessGroup> subgroup(const std::vector<int>& members, int color, int key) override;
  std::shared_ptr<LocalHub> hub_;
  int rank_;
  int64_t splits_ = 0;  // split() calls so far: with the first member, names the sub-group's hub
};

struct LocalRunOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

// Runs fn on `world_size` threads, rank r with its own Context(r) made current and a
// LocalGroup. If any rank throws, the others are woken (or time out), and the first
// failure -- not the aborts it caused -- is rethrown as "rank r: ...". A failed collective
// that no rank waited for is rethrown once every rank has returned. A rank still running
// `timeout` after another failed (stuck outside any collective, where nothing wakes it)
// cannot be stopped: the process ends then, with exit status 1 and a line on stderr.
void run_local(int world_size, const std::function<void(ProcessGroup&)>& fn, LocalRunOptions options = {});

}  // namespace zg::dist
