#include "dist/comm/local_group.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <system_error>
#include <thread>

#include "tensor/backend.h"
#include "tensor/context.h"

namespace zg::dist {

namespace {

// acc = acc (op) x, through the backend directly: collectives write buffers without
// bumping storage versions (a re-gathered ZeRO-3 unit keeps its saved views valid).
void combine(const Tensor& acc, const Tensor& x, ReduceKind op) {
  backend(acc.device()).binary(op == ReduceKind::max ? BinaryOp::maximum : BinaryOp::add, acc, x, acc);
}

void finish(const Tensor& acc, ReduceKind op, int size) {
  if (op == ReduceKind::average) scale_buffer(acc, 1.0 / size);
}

Tensor scratch_like(const Tensor& t, DType dtype) {
  MemoryScope scope(MemoryCategory::communication);
  return empty(t.shape(), TensorOptions(dtype).device(t.device()));
}
Tensor scratch_like(const Tensor& t) { return scratch_like(t, t.dtype()); }

int valid_world_size(int size) {
  ZG_CHECK(size >= 1, "local group: world size must be at least 1, got ", size);
  return size;
}

}  // namespace

LocalHub::LocalHub(int size, std::chrono::milliseconds timeout)
    : size_(valid_world_size(size)), timeout_(checked_timeout("local group", timeout)), posted_(size),
      calls_made_(size, 0), departed_(size, false) {}

std::string LocalHub::failure() {
  std::lock_guard lock(mutex_);
  return aborted_ ? abort_reason_ : std::string();
}

// Sub-hubs are told outside this hub's lock, so no two shared hubs' locks are ever held
// at once (child() aborts a new sub-hub under it, before any other thread can see it).
void LocalHub::depart(int rank) {
  std::vector<std::pair<std::shared_ptr<LocalHub>, int>> children;
  {
    std::lock_guard lock(mutex_);
    departed_[rank] = true;
    cv_.notify_all();
    for (const Child& c : children_)
      if (const auto at = std::find(c.members.begin(), c.members.end(), rank); at != c.members.end())
        children.emplace_back(c.hub, static_cast<int>(at - c.members.begin()));
  }
  for (const auto& [hub, index] : children) hub->depart(index);
}

void LocalHub::abort(int rank, const std::string& reason) { abort_with("rank " + std::to_string(rank) + " failed: " + reason); }

void LocalHub::abort_with(const std::string& reason) {
  std::vector<std::shared_ptr<LocalHub>> children;
  {
    std::lock_guard lock(mutex_);
    if (!aborted_) {
      aborted_ = true;
      abort_reason_ = reason;
    }
    cv_.notify_all();
    for (const Child& c : children_) children.push_back(c.hub);
  }
  for (const auto& hub : children) hub->abort_with(reason);  // the rank named is this hub's
}

std::shared_ptr<LocalHub> LocalHub::child(int64_t split, const std::vector<int>& members) {
  std::lock_guard lock(mutex_);
  for (const Child& c : children_)
    if (c.split == split && c.members.front() == members.front()) return c.hub;
  auto hub = std::make_shared<LocalHub>(static_cast<int>(members.size()), timeout_);
  if (aborted_) hub->abort_with(abort_reason_);
  children_.push_back({split, members, hub});
  return hub;
}

void LocalHub::fail_locked(const std::string& message) {
  if (!aborted_) {
    aborted_ = true;
    abort_reason_ = message;
  }
  cv_.notify_all();
  throw Error(message);
}

void LocalHub::rendezvous(int rank, const std::string& where, const std::function<std::string()>& check) {
  std::unique_lock lock(mutex_);
  auto failed = [&] {
    return Error(!mismatch_.empty() ? mismatch_
                                    : "local group: rank " + std::to_string(rank) + " in " + where + ": " + abort_reason_);
  };
  if (aborted_) throw failed();
  const uint64_t generation = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    if (check) {
      if (std::string problem = check(); !problem.empty()) {
        mismatch_ = abort_reason_ = problem;
        aborted_ = true;
      }
    }
    cv_.notify_all();
    if (aborted_) throw failed();
    return;
  }
  // A rank that has returned from its function will never arrive.
  const auto departed = [&] { return std::find(departed_.begin(), departed_.end(), true) != departed_.end(); };
  const bool done =
      cv_.wait_for(lock, timeout_, [&] { return generation_ != generation || aborted_ || departed(); });
  // Every rank arrived: the rendezvous is over, even if a rank has failed since (it may
  // have left first and thrown before this one woke) -- unless its check found a mismatch.
  if (generation_ != generation) {
    if (!mismatch_.empty()) throw failed();
    return;
  }
  if (aborted_) throw failed();
  if (departed()) {
    std::string gone;
    for (int q = 0; q < size_; ++q)
      if (departed_[q]) gone += (gone.empty() ? "" : ", ") + std::to_string(q) + " (after " +
                                std::to_string(calls_made_[q]) + " collectives)";
    fail_locked("local group: rank " + std::to_string(rank) + " in " + where + " waits for rank(s) " + gone +
                " that returned from the function without calling it");
  }
  if (!done) {
    std::string missing;
    for (int q = 0; q < size_; ++q)
      if (calls_made_[q] < calls_made_[rank]) missing += (missing.empty() ? "" : ", ") + std::to_string(q);
    fail_locked("local group: rank " + std::to_string(rank) + " timed out after " +
                std::to_string(timeout_.count()) + " ms in " + where + " waiting for rank(s) " +
                (missing.empty() ? std::string("?") : missing));
  }
}

void LocalHub::enter(int rank, const Collective& call) {
  int64_t index;
  {
    std::lock_guard lock(mutex_);
    // A failed group keeps what was posted: another rank's worker may still be reading it
    // (a retry overwrote it under that read: ThreadSanitizer). The rendezvous then throws.
    if (!aborted_) posted_[rank] = call;
    index = calls_made_[rank]++;
  }
  rendezvous(rank, std::string(name(call.op)) + " #" + std::to_string(index), [&]() -> std::string {
    std::vector<Collective::Signature> all;
    for (const Collective& posted : posted_) all.push_back(posted.signature());
    return Collective::mismatch(all, index, "local group");
  });
}

void LocalHub::leave(int rank) {
  rendezvous(rank, "the end of a collective");
  std::lock_guard lock(mutex_);
  posted_[rank] = Collective{};
}

// Between the two rendezvous every rank reads the others' posted inputs and
// computes its result in scratch memory; it writes its own output only after the
// second, when nobody reads its input any more.
//
// On a GPU the ranks' kernels run on their own streams, so each rank synchronizes
// its stream (on this worker thread, never the training thread) before the first
// rendezvous -- its input is complete when others read it -- and before the second --
// its reads of others' inputs are done when they go on.
//
// A failure inside (a scratch buffer over the memory cap, a device error) aborts the
// hub: the others are mid-collective with this rank, and a retry would pair its next
// call with their previous one -- wrong sums, silently. As with NCCL, a group whose
// collective failed is finished; every rank ends with this rank's error. Its posted
// buffers stay held by the hub until the group ends: the others may still be reading
// them when this rank's wait() returns (what they compute is thrown away).
void LocalGroup::run(const Collective& c) {
  try {
    exchange(c);
  } catch (const std::exception& e) {
    hub_->abort(rank_, std::string(name(c.op)) + ": " + e.what());
    throw;
  }
}

void LocalGroup::exchange(const Collective& c) {
  const Device device = c.output.defined() ? c.output.device() : kCPU;
  Backend& kernels = backend(device);
  kernels.synchronize(device);
  hub_->enter(rank_, c);
  const int n = size();
  // Buffers are contiguous and matched by dtype and element count, not shape (as in
  // NCCL): every rank's buffer is read as a flat run of elements.
  const auto flat = [](const Tensor& t) { return t.view({t.numel()}); };
  const auto input_of = [&](int q) { return flat(hub_->call_of(q).input); };
  const Tensor output = c.output.defined() ? flat(c.output) : Tensor();
  Tensor result;  // what this rank writes into its output after the second rendezvous
  switch (c.op) {
    case CollectiveOp::all_reduce:
    case CollectiveOp::reduce_scatter: {
      const int64_t count = output.numel();
      const auto part = [&](int q) {
        return c.op == CollectiveOp::all_reduce ? input_of(q) : input_of(q).narrow(0, rank_ * count, count);
      };
      // Summed in the buffer's dtype, as NCCL does (bf16 rounded after each rank's add) --
      // except f16, summed in f32: its range ends at 65504, and a sum of N (loss-scaled)
      // gradients overflows where their average does not. (The mpi group sums both 16-bit
      // dtypes in f32, MPI having no type for them: its bf16 sums can differ in the last
      // bit.) A part in another dtype (or on another GPU) is brought over kStage elements
      // at a time, so the scratch past the result stays small.
      constexpr int64_t kStage = int64_t(1) << 20;
      result = scratch_like(output, output.dtype() == DType::f16 ? DType::f32 : output.dtype());
      kernels.copy(part(0), result);
      Tensor staged;
      for (int q = 1; q < n; ++q) {
        const Tensor other = part(q);
        if (other.device() == result.device() && other.dtype() == result.dtype()) {
          combine(result, other, c.reduce);
          continue;
        }
        if (!staged.defined()) staged = scratch_like(result.narrow(0, 0, std::min(count, kStage)));
        for (int64_t begin = 0; begin < count; begin += kStage) {
          const int64_t length = std::min(kStage, count - begin);
          const Tensor piece = staged.narrow(0, 0, length);
          kernels.copy(other.narrow(0, begin, length), piece);
          combine(result.narrow(0, begin, length), piece, c.reduce);
        }
      }
      finish(result, c.reduce, n);
      break;
    }
    case CollectiveOp::all_gather: {
      // Written now: others read only our input, which is our own slot if it lies in our output.
      const int64_t shard = c.input.numel();
      for (int q = 0; q < n; ++q) {
        const Tensor source = input_of(q);
        const Tensor slot = output.narrow(0, q * shard, shard);
        if (source.storage() == slot.storage() && source.offset() == slot.offset()) continue;  // already in place
        kernels.copy(source, slot);
      }
      break;
    }
    case CollectiveOp::broadcast:
      if (rank_ != c.root) {
        result = scratch_like(output);
        kernels.copy(input_of(c.root), result);
      }
      break;
    case CollectiveOp::barrier:
    case CollectiveOp::send:  // messages are posted to the hub, not run here (local_p2p.cpp)
    case CollectiveOp::recv: break;
  }
  kernels.synchronize(device);
  hub_->leave(rank_);
  if (result.defined()) kernels.copy(result, output);
}

std::unique_ptr<ProcessGroup> LocalGroup::subgroup(const std::vector<int>& members, int, int) {
  const auto at = std::find(members.begin(), members.end(), rank_);
  return std::make_unique<LocalGroup>(hub_->child(splits_++, members), static_cast<int>(at - members.begin()));
}

namespace {

// What run_local's rank threads report as they end. Once a rank has failed, the others
// get the group's timeout to return: those in a collective are woken at once by the
// abort, but one stuck outside any (computing, sleeping) is reached by nothing, and a
// thread cannot be stopped. Rather than keep a failed job alive until it returns, the
// process then ends, as PyTorch's watchdog ends one whose collective timed out.
class RankOutcomes {
 public:
  explicit RankOutcomes(int world_size) : errors_(world_size), running_(world_size, true) {}

  void fail(int r, const std::string& error) {
    std::lock_guard lock(mutex_);
    errors_[r] = error;
    if (root_cause_ < 0) root_cause_ = r, failed_at_ = std::chrono::steady_clock::now();
  }
  void finish(int r) {
    {
      std::lock_guard lock(mutex_);
      running_[r] = false;
    }
    cv_.notify_all();
  }
  // Returns once every rank in `started` has finished, or ends the process (above).
  void wait(int started, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    const auto all_done = [&] { return std::none_of(running_.begin(), running_.begin() + started, std::identity()); };
    cv_.wait(lock, [&] { return all_done() || root_cause_ >= 0; });
    if (cv_.wait_until(lock, failed_at_ + timeout, all_done)) return;
    std::string stuck;
    for (int r = 0; r < started; ++r)
      if (running_[r]) stuck += (stuck.empty() ? "" : ", ") + std::to_string(r);
    std::fprintf(stderr, "local group: rank(s) %s still running %lld ms after rank %d failed (%s), outside any "
                 "collective, where no abort reaches them; a thread cannot be stopped, so the process ends (exit "
                 "status 1)\n", stuck.c_str(), static_cast<long long>(timeout.count()), root_cause_,
                 errors_[root_cause_].c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }
  void throw_root_cause() const {
    if (root_cause_ >= 0) throw Error("rank " + std::to_string(root_cause_) + ": " + errors_[root_cause_]);
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::string> errors_;
  std::vector<bool> running_;
  int root_cause_ = -1;  // the first rank that failed (not the aborts it caused)
  std::chrono::steady_clock::time_point failed_at_;
};

}  // namespace

void run_local(int world_size, const std::function<void(ProcessGroup&)>& fn, LocalRunOptions options) {
  auto hub = std::make_shared<LocalHub>(world_size, options.timeout);
  RankOutcomes outcomes(world_size);
  const auto fail_rank = [&](int r, const std::string& error) {
    outcomes.fail(r, error);
    hub->abort(r, error);
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    try {
      threads.emplace_back([&, r] {
        std::string error;
        try {
          Context context(r);
          ContextGuard guard(context);
          LocalGroup group(hub, r);
          try {
            fn(group);
          } catch (const std::exception& e) {
            error = e.what();
          } catch (...) {  // nothing may escape a thread's body: it would end the process
            error = "an exception that is not a std::exception";
          }
          if (!error.empty()) fail_rank(r, error);
        } catch (const std::exception& e) {  // the rank's context or group could not be made, or went wrong
          if (error.empty()) fail_rank(r, error = e.what());
        }  // the group's worker has run this rank's queued collectives
        if (error.empty()) hub->depart(r);
        outcomes.finish(r);
      });
    } catch (const std::system_error& e) {  // no thread for rank r: the started ranks must not wait for it
      fail_rank(r, std::string("could not start its thread: ") + e.what());
      break;
    }
  }
  outcomes.wait(static_cast<int>(threads.size()), checked_timeout("local group", options.timeout));
  for (auto& t : threads) t.join();
  outcomes.throw_root_cause();
  // Every rank returned, but a collective that none waited for failed (a mismatch).
  if (const std::string failure = hub->failure(); !failure.empty()) throw Error(failure);
}

}  // namespace zg::dist
