#include "dist/local_group.h"

#include <thread>

#include "tensor/backend.h"
#include "tensor/context.h"

namespace zg::dist {

namespace {

const char* reduce_name(ReduceKind op) {
  switch (op) {
    case ReduceKind::sum: return "sum";
    case ReduceKind::average: return "average";
    case ReduceKind::max: return "max";
  }
  return "?";
}

// acc = acc (op) x, through the backend directly: collectives write buffers without
// bumping storage versions (a re-gathered ZeRO-3 unit keeps its saved views valid).
void combine(const Tensor& acc, const Tensor& x, ReduceKind op) {
  backend(acc.device()).binary(op == ReduceKind::max ? BinaryOp::maximum : BinaryOp::add, acc, x, acc);
}

void finish(const Tensor& acc, ReduceKind op, int size) {
  if (op != ReduceKind::average) return;
  const Tensor factor = full({}, 1.0 / size, TensorOptions(acc.dtype()).device(acc.device()));
  backend(acc.device()).binary(BinaryOp::mul, acc, factor.expand(acc.shape()), acc);
}

Tensor scratch_like(const Tensor& t) {
  MemoryScope scope(MemoryCategory::communication);
  return empty(t.shape(), TensorOptions(t.dtype()).device(t.device()));
}

}  // namespace

std::string LocalHub::Call::describe() const {
  std::string s = op + "(" + (input.defined() ? zg::describe(input) : "-");
  if (output.defined() && !output.is_same(input)) s += " -> " + zg::describe(output);
  if (op == "all_reduce" || op == "reduce_scatter") s += std::string(", ") + reduce_name(reduce);
  if (op == "broadcast") s += ", root " + std::to_string(root);
  return s + ")";
}

LocalHub::LocalHub(int size, std::chrono::milliseconds timeout)
    : size_(size), timeout_(timeout), posted_(size), calls_made_(size, 0) {
  ZG_CHECK(size >= 1, "local group: world size must be at least 1, got ", size);
}

void LocalHub::abort(int rank, const std::string& reason) {
  std::lock_guard lock(mutex_);
  if (!aborted_) {
    aborted_ = true;
    abort_reason_ = "rank " + std::to_string(rank) + " failed: " + reason;
  }
  cv_.notify_all();
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
  const bool done =
      cv_.wait_for(lock, timeout_, [&] { return generation_ != generation || aborted_; });
  if (aborted_) throw failed();
  if (generation_ != generation) return;
  if (!done) {
    std::string missing;
    for (int q = 0; q < size_; ++q)
      if (calls_made_[q] < calls_made_[rank]) missing += (missing.empty() ? "" : ", ") + std::to_string(q);
    fail_locked("local group: rank " + std::to_string(rank) + " timed out after " +
                std::to_string(timeout_.count()) + " ms in " + where + " waiting for rank(s) " +
                (missing.empty() ? std::string("?") : missing));
  }
}

void LocalHub::enter(int rank, const Call& call) {
  int64_t index;
  {
    std::lock_guard lock(mutex_);
    posted_[rank] = call;
    index = calls_made_[rank]++;
  }
  rendezvous(rank, call.op + " #" + std::to_string(index), [&]() -> std::string {
    // Every call is compared with rank 0's.
    const Call& first = posted_[0];
    auto same = [](const Tensor& a, const Tensor& b) {
      return a.defined() == b.defined() &&
             (!a.defined() || (a.numel() == b.numel() && a.dtype() == b.dtype() && a.device().type == b.device().type));
    };
    for (int q = 1; q < size_; ++q) {
      const Call& other = posted_[q];
      if (first.op != other.op || first.reduce != other.reduce || first.root != other.root ||
          !same(first.input, other.input) || !same(first.output, other.output))
        return "local group: collective #" + std::to_string(index) + " does not match across ranks: rank 0 called " +
               first.describe() + ", rank " + std::to_string(q) + " called " + other.describe();
    }
    return "";
  });
}

void LocalHub::leave(int rank) {
  rendezvous(rank, "the end of a collective");
  std::lock_guard lock(mutex_);
  posted_[rank] = Call{};
}

void LocalGroup::all_reduce(const Tensor& buffer, ReduceKind op) {
  hub_->enter(rank_, {"all_reduce", buffer, buffer, op, 0});
  const Tensor acc = scratch_like(buffer);
  backend(buffer.device()).copy(hub_->call_of(0).input, acc);
  for (int q = 1; q < size(); ++q) combine(acc, hub_->call_of(q).input, op);
  finish(acc, op, size());
  hub_->leave(rank_);
  backend(buffer.device()).copy(acc, buffer);
  count_ring(2.0 * (size() - 1) / size(), buffer.nbytes());
}

void LocalGroup::reduce_scatter(const Tensor& input, const Tensor& output, ReduceKind op) {
  ZG_CHECK(input.dim() == 1 && output.dim() == 1 && input.numel() == output.numel() * size() &&
               input.dtype() == output.dtype(),
           "reduce_scatter: input ", describe(input), " must be 1-D and world size (", size(), ") times output ",
           describe(output));
  hub_->enter(rank_, {"reduce_scatter", input, output, op, 0});
  const int64_t shard = output.numel();
  const Tensor acc = scratch_like(output);
  backend(output.device()).copy(hub_->call_of(0).input.narrow(0, rank_ * shard, shard), acc);
  for (int q = 1; q < size(); ++q) combine(acc, hub_->call_of(q).input.narrow(0, rank_ * shard, shard), op);
  finish(acc, op, size());
  hub_->leave(rank_);
  backend(output.device()).copy(acc, output);
  count_ring(static_cast<double>(size() - 1) / size(), input.nbytes());
}

void LocalGroup::all_gather(const Tensor& input, const Tensor& output) {
  ZG_CHECK(input.dim() == 1 && output.dim() == 1 && output.numel() == input.numel() * size() &&
               input.dtype() == output.dtype(),
           "all_gather: output ", describe(output), " must be 1-D and world size (", size(), ") times input ",
           describe(input));
  hub_->enter(rank_, {"all_gather", input, output, ReduceKind::sum, 0});
  const int64_t shard = input.numel();
  for (int q = 0; q < size(); ++q) {
    const Tensor& source = hub_->call_of(q).input;
    const Tensor slot = output.narrow(0, q * shard, shard);
    if (source.storage() == slot.storage() && source.offset() == slot.offset()) continue;  // already in place
    backend(output.device()).copy(source, slot);
  }
  hub_->leave(rank_);
  count_ring(static_cast<double>(size() - 1) / size(), output.nbytes());
}

void LocalGroup::broadcast(const Tensor& buffer, int root) {
  ZG_CHECK(root >= 0 && root < size(), "broadcast: root ", root, " is not a rank of a group of ", size());
  hub_->enter(rank_, {"broadcast", buffer, buffer, ReduceKind::sum, root});
  if (rank_ != root) backend(buffer.device()).copy(hub_->call_of(root).input, buffer);
  hub_->leave(rank_);
  count_ring(static_cast<double>(size() - 1) / size(), buffer.nbytes());
}

void LocalGroup::barrier() {
  hub_->enter(rank_, {"barrier", Tensor(), Tensor(), ReduceKind::sum, 0});
  hub_->leave(rank_);
}

void run_local(int world_size, const std::function<void(ProcessGroup&)>& fn, LocalRunOptions options) {
  auto hub = std::make_shared<LocalHub>(world_size, options.timeout);
  std::vector<std::string> errors(world_size);
  std::vector<bool> root_cause(world_size, false);
  std::mutex errors_mutex;
  bool first_failure_seen = false;
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      Context context(r);
      ContextGuard guard(context);
      LocalGroup group(hub, r);
      try {
        fn(group);
      } catch (const std::exception& e) {
        {
          std::lock_guard lock(errors_mutex);
          errors[r] = e.what();
          if (!first_failure_seen) root_cause[r] = first_failure_seen = true;
        }
        hub->abort(r, e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world_size; ++r)
    if (root_cause[r]) throw Error("rank " + std::to_string(r) + ": " + errors[r]);
}

}  // namespace zg::dist
