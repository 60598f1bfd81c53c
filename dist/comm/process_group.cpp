#include "dist/comm/process_group.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "autograd/graph.h"
#include "tensor/backend.h"
#include "tensor/context.h"
#include "tensor/trace.h"

namespace zg::dist {

const char* name(ReduceKind op) {
  switch (op) {
    case ReduceKind::sum: return "sum";
    case ReduceKind::average: return "average";
    case ReduceKind::max: return "max";
  }
  return "?";
}

const char* name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::all_reduce: return "all_reduce";
    case CollectiveOp::reduce_scatter: return "reduce_scatter";
    case CollectiveOp::all_gather: return "all_gather";
    case CollectiveOp::broadcast: return "broadcast";
    case CollectiveOp::barrier: return "barrier";
    case CollectiveOp::send: return "send";
    case CollectiveOp::recv: return "recv";
  }
  return "?";
}

std::string Collective::describe() const { return describe(signature()); }

int64_t Collective::ring_bytes(int world_size) const {
  const double share = static_cast<double>(world_size - 1) / world_size;
  double bytes = 0;
  switch (op) {
    case CollectiveOp::all_reduce: bytes = 2 * share * static_cast<double>(input.nbytes()); break;
    case CollectiveOp::reduce_scatter: bytes = share * static_cast<double>(input.nbytes()); break;
    case CollectiveOp::all_gather: bytes = share * static_cast<double>(output.nbytes()); break;
    case CollectiveOp::broadcast: bytes = share * static_cast<double>(input.nbytes()); break;
    case CollectiveOp::send: bytes = static_cast<double>(input.nbytes()); break;
    case CollectiveOp::barrier:
    case CollectiveOp::recv: break;
  }
  return static_cast<int64_t>(bytes + 0.5);
}

Collective::Signature Collective::signature() const {
  const auto dtype = [](const Tensor& t) { return t.defined() ? static_cast<int64_t>(t.dtype()) : -1; };
  const auto numel = [](const Tensor& t) { return t.defined() ? t.numel() : -1; };
  const Tensor& any = input.defined() ? input : output;
  return {static_cast<int64_t>(op), static_cast<int64_t>(reduce), root, dtype(input), numel(input), dtype(output),
          numel(output), any.defined() ? static_cast<int64_t>(any.device().type) : -1, tag};
}

// "reduce_scatter(bf16[1024] on cpu -> bf16[256] on cpu, average)"
std::string Collective::describe(const Signature& s) {
  static constexpr const char* kDeviceTypes[] = {"cpu", "cuda", "meta"};
  const auto side = [&](int64_t dtype, int64_t n) {
    return std::string(name(static_cast<DType>(dtype))) + "[" + std::to_string(n) + "] on " + kDeviceTypes[s[7]];
  };
  const auto op = static_cast<CollectiveOp>(s[0]);
  std::string text = std::string(name(op)) + "(" + (s[3] >= 0 ? side(s[3], s[4]) : "");
  if (op == CollectiveOp::reduce_scatter || op == CollectiveOp::all_gather) text += " -> " + side(s[5], s[6]);
  if (op == CollectiveOp::all_reduce || op == CollectiveOp::reduce_scatter)
    text += std::string(", ") + name(static_cast<ReduceKind>(s[1]));
  if (op == CollectiveOp::broadcast) text += ", root " + std::to_string(s[2]);
  if (op == CollectiveOp::send || op == CollectiveOp::recv)
    text += std::string(op == CollectiveOp::send ? ", to" : ", from") + " rank " + std::to_string(s[2]);
  if (s[8] != 0) text += ", tag " + std::to_string(s[8]);
  return text + ")";
}

namespace {
thread_local int64_t collective_tag = 0;
}

CollectiveTag::CollectiveTag(int64_t tag) : previous_(collective_tag) { collective_tag = tag; }
CollectiveTag::~CollectiveTag() { collective_tag = previous_; }
int64_t CollectiveTag::current() { return collective_tag; }

std::string Collective::mismatch(const std::vector<Signature>& all, int64_t index, const std::string& group) {
  for (size_t q = 1; q < all.size(); ++q)
    if (all[q] != all[0])
      return group + ": collective #" + std::to_string(index) + " does not match across ranks: rank 0 called " +
             describe(all[0]) + ", rank " + std::to_string(q) + " called " + describe(all[q]);
  return "";
}

// A send and its receive agree on what moves: dtype, numel, device type and tag (the
// ops and peers differ by nature).
std::string Collective::p2p_mismatch(const Signature& send, const Signature& recv, int src, int dst, int64_t index,
                                     const std::string& group) {
  const bool agree = send[3] == recv[3] && send[4] == recv[4] && send[7] == recv[7] && send[8] == recv[8];
  if (agree) return "";
  return group + ": message #" + std::to_string(index) + " from rank " + std::to_string(src) + " to rank " +
         std::to_string(dst) + " does not match: rank " + std::to_string(src) + " sent " + describe(send) + ", rank " +
         std::to_string(dst) + " receives " + describe(recv);
}

void scale_buffer(const Tensor& buffer, double factor) {
  const Tensor scalar = full({}, factor, TensorOptions(buffer.dtype()).device(buffer.device()));
  backend(buffer.device()).binary(BinaryOp::mul, buffer, scalar.expand(buffer.shape()), buffer);
}

// ---- the communication worker -------------------------------------------------

namespace {

class HostWork final : public Work {
 public:
  // Each waiter gets its own Error with the collective's message: an exception object
  // is never shared between the worker and the waiting threads. An OutOfMemory stays
  // one, so a caller can tell a full device from a broken call.
  void wait() override {
    std::unique_lock lock(mutex_);
    done_cv_.wait(lock, [&] { return done_; });
    if (out_of_memory_) throw OutOfMemory(error_);
    if (failed_) throw Error(error_);
  }
  bool completed() const override {
    std::lock_guard lock(mutex_);
    return done_;
  }
  void finish(bool failed, bool out_of_memory, std::string error) {
    std::lock_guard lock(mutex_);
    done_ = true;
    failed_ = failed;
    out_of_memory_ = out_of_memory;
    error_ = std::move(error);
    done_cv_.notify_all();
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false, failed_ = false, out_of_memory_ = false;
  std::string error_;
};

}  // namespace

// One thread per group that runs its collectives in issue order. A job carries
// the issuing rank's Context and memory category, so scratch buffers a collective
// allocates are counted for that rank, under the category its caller chose.
class CommWorker {
 public:
  explicit CommWorker(std::function<void(const Collective&)> run) : run_(std::move(run)) {}
  ~CommWorker() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
      queue_cv_.notify_all();
    }
    if (thread_.joinable()) thread_.join();
  }

  WorkHandle enqueue(Collective collective) {
    auto work = std::make_shared<HostWork>();
    std::lock_guard lock(mutex_);
    if (!thread_.joinable()) thread_ = std::thread([this] {
      set_trace_thread_name("communication");
      loop();
    });
    queue_.push_back({std::move(collective), &Context::current(), MemoryScope::current(), work});
    queue_cv_.notify_all();
    return work;
  }

 private:
  struct Job {
    Collective collective;
    Context* context;
    MemoryCategory category;
    std::shared_ptr<HostWork> work;
  };

  void loop() {
    for (;;) {
      Job job;
      {
        std::unique_lock lock(mutex_);
        queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and everything issued has run
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      bool failed = false, out_of_memory = false;
      std::string error;
      try {
        ContextGuard context(*job.context);
        MemoryScope scope(job.category);
        // A collective is never differentiable. With grad mode on (each thread's own), a
        // view of a rank's requires-grad buffer would record autograd here and write the
        // leaf's state (its gradient accumulator) while the rank's thread uses it.
        NoGradGuard no_grad;
        run_(job.collective);
      } catch (const OutOfMemory& e) {
        failed = out_of_memory = true;
        error = e.what();
      } catch (const std::exception& e) {
        failed = true;
        error = e.what();
      }
      job.collective = Collective{};  // the buffers go before waiters wake: freed memory is freed when wait() returns
      job.work->finish(failed, out_of_memory, std::move(error));
    }
  }

  std::function<void(const Collective&)> run_;
  std::mutex mutex_;
  std::condition_variable queue_cv_;
  std::deque<Job> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

HostGroup::HostGroup()
    : worker_(std::make_unique<CommWorker>([this](const Collective& c) {
        TraceRange range(name(c.op));  // the transfer itself, on the worker's row of the timeline
        run(c);
      })) {}

HostGroup::~HostGroup() = default;

void HostGroup::stop_worker() { worker_.reset(); }

WorkHandle HostGroup::issue(Collective c) {
  ZG_CHECK(worker_ != nullptr, name(c.op), ": the ", kind(), " process group is shutting down");
  return worker_->enqueue(std::move(c));
}

// ---- every group ----------------------------------------------------------------

std::chrono::milliseconds checked_timeout(const char* group, std::chrono::milliseconds timeout) {
  ZG_CHECK(timeout.count() > 0, group, ": the timeout must be positive, got ", timeout.count(), " ms");
  return std::min<std::chrono::milliseconds>(timeout, std::chrono::hours(24 * 365 * 100));
}

WorkHandle ProcessGroup::submit(Collective c) {
  TraceRange range(name(c.op));
  c.tag = CollectiveTag::current();
  const int64_t bytes = c.ring_bytes(size());
  WorkHandle work = issue(std::move(c));
  bytes_sent_ += bytes;  // once issued: a collective refused up front sent nothing
  return work;
}

namespace {

// Every buffer of a collective: defined and contiguous (no broadcast dims: several
// elements cannot receive one value each through one address).
void check_buffer(const char* op, const char* which, const Tensor& t) {
  ZG_CHECK(t.defined(), op, ": the ", which, " is undefined");
  ZG_CHECK(t.is_contiguous(), op, ": the ", which, " ", describe(t), " with strides ", shape_str(t.strides()),
           " is not contiguous");
}

// What a reduction adds up: numbers (bools have no sum), and for an average floating
// ones (integers would round 1/N to 0).
void check_reducible(const char* op, const Tensor& t, ReduceKind reduce) {
  ZG_CHECK(t.dtype() != DType::boolean, op, ": cannot reduce ", describe(t), " (", name(reduce),
           " of bools); use an integer dtype");
  ZG_CHECK(reduce != ReduceKind::average || is_floating(t.dtype()), op, ": average of ", describe(t),
           " needs a floating-point dtype");
}

// The full buffer is world size times the shard, both 1-D, of one dtype and device. In
// place (one storage), the shard must be exactly this rank's slice of the full buffer --
// NCCL's rule, and the only overlap where no rank reads bytes that it also writes.
void check_full_and_shard(const char* op, const char* full_name, const Tensor& full, const char* shard_name,
                          const Tensor& shard, int world_size, int rank) {
  check_buffer(op, full_name, full);
  check_buffer(op, shard_name, shard);
  ZG_CHECK(full.dim() == 1 && shard.dim() == 1 && full.numel() == shard.numel() * world_size &&
               full.dtype() == shard.dtype() && full.device() == shard.device(),
           op, ": ", full_name, " ", describe(full), " must be 1-D and world size (", world_size, ") times ",
           shard_name, " ", describe(shard));
  if (full.storage() != shard.storage()) return;
  const int64_t own = full.offset() + rank * shard.numel();
  ZG_CHECK(shard.offset() == own, op, ": ", shard_name, " shares its storage with ", full_name, " but is not rank ",
           rank, "'s slice of it (elements ", own, " to ", own + shard.numel(), " of the storage; it starts at ",
           shard.offset(), "): in place, a rank's shard must be its own slice");
}

}  // namespace

WorkHandle ProcessGroup::all_reduce_async(const Tensor& buffer, ReduceKind op) {
  check_buffer("all_reduce", "buffer", buffer);
  check_reducible("all_reduce", buffer, op);
  begin_inplace(buffer, "all_reduce");
  return submit({CollectiveOp::all_reduce, buffer, buffer, op, 0});
}

WorkHandle ProcessGroup::reduce_scatter_async(const Tensor& input, const Tensor& output, ReduceKind op) {
  check_full_and_shard("reduce_scatter", "input", input, "output", output, size(), rank());
  check_reducible("reduce_scatter", input, op);
  begin_inplace(output, "reduce_scatter");
  return submit({CollectiveOp::reduce_scatter, input, output, op, 0});
}

WorkHandle ProcessGroup::all_gather_async(const Tensor& input, const Tensor& output) {
  check_full_and_shard("all_gather", "output", output, "input", input, size(), rank());
  begin_inplace(output, "all_gather");
  return submit({CollectiveOp::all_gather, input, output, ReduceKind::sum, 0});
}

WorkHandle ProcessGroup::broadcast_async(const Tensor& buffer, int root) {
  check_buffer("broadcast", "buffer", buffer);
  ZG_CHECK(root >= 0 && root < size(), "broadcast: root ", root, " is not a rank of a group of ", size());
  begin_inplace(buffer, "broadcast");
  return submit({CollectiveOp::broadcast, buffer, buffer, ReduceKind::sum, root});
}

// Every rank's (colour, key), all-gathered on the CPU (which also checks that every rank
// calls split, within the group's timeout), then this rank's colour-mates in key order.
std::unique_ptr<ProcessGroup> ProcessGroup::split(int color, int key) {
  ZG_CHECK(accepts(kCPU), "split: the ", kind(), " group takes no CPU tensors to exchange colours; it must override split");
  const Tensor mine = tensor<int64_t>({color, key});
  const Tensor all = empty({2 * int64_t(size())}, TensorOptions(DType::i64));
  all_gather(mine, all);
  const std::vector<int64_t> pairs = all.to_vector<int64_t>();
  std::vector<int> members;
  for (int q = 0; q < size(); ++q)
    if (pairs[2 * q] == color) members.push_back(q);
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return pairs[2 * a + 1] < pairs[2 * b + 1]; });
  return subgroup(members, color, key);
}

std::unique_ptr<ProcessGroup> ProcessGroup::subgroup(const std::vector<int>&, int, int) {
  fail("split: the ", kind(), " group cannot form sub-groups");
}

std::unique_ptr<ProcessGroup> ProcessGroup::split_grid(int size, int stride) {
  ZG_CHECK(size >= 1 && stride >= 1 && this->size() % (size * stride) == 0, "split_grid: ", size, " ranks ", stride,
           " apart do not tile the group's ", this->size(), " ranks");
  return make_grid(size, stride);
}

std::unique_ptr<ProcessGroup> ProcessGroup::make_grid(int size, int stride) {
  const int j = rank() / stride % size;
  return split(rank() - j * stride, j);
}

// ---- point to point ---------------------------------------------------------------

namespace {
// A batch's Work: done when every message is.
class AllOf final : public Work {
 public:
  explicit AllOf(std::vector<WorkHandle> works) : works_(std::move(works)) {}
  void wait() override {
    for (const WorkHandle& w : works_) w->wait();
  }
  bool completed() const override {
    return std::all_of(works_.begin(), works_.end(), [](const WorkHandle& w) { return w->completed(); });
  }

 private:
  std::vector<WorkHandle> works_;
};
}  // namespace

Collective ProcessGroup::message(const P2POp& op) const {
  const bool sending = op.kind == P2POp::send;
  const char* what = sending ? "send" : "recv";
  check_buffer(what, sending ? "tensor" : "buffer", op.buffer);
  ZG_CHECK(op.peer >= 0 && op.peer < size() && op.peer != rank(), what, ": peer ", op.peer, " is not another rank of ",
           "this group (rank ", rank(), " of ", size(), ")");
  ZG_CHECK(accepts(op.buffer.device()), what, ": the ", kind(), " group does not take ", describe(op.buffer));
  if (!sending) begin_inplace(op.buffer, "recv");
  Collective c{sending ? CollectiveOp::send : CollectiveOp::recv, op.buffer, op.buffer, ReduceKind::sum, op.peer};
  c.tag = op.tag;
  return c;
}

WorkHandle ProcessGroup::send_async(const Tensor& tensor, int dst, int64_t tag) {
  return batch_async({{P2POp::send, tensor, dst, tag}});
}

WorkHandle ProcessGroup::recv_async(const Tensor& buffer, int src, int64_t tag) {
  return batch_async({{P2POp::recv, buffer, src, tag}});
}

// Every message is validated before any is posted: a refused batch posted nothing.
WorkHandle ProcessGroup::batch_async(const std::vector<P2POp>& ops) {
  TraceRange range(ops.size() == 1 ? (ops[0].kind == P2POp::send ? "send" : "recv") : "batch_isend_irecv");
  std::vector<Collective> messages;
  int64_t bytes = 0;
  for (const P2POp& op : ops) {
    messages.push_back(message(op));
    bytes += messages.back().ring_bytes(size());
  }
  std::vector<WorkHandle> works = issue_p2p(std::move(messages));
  bytes_sent_ += bytes;
  return works.size() == 1 ? works[0] : std::make_shared<AllOf>(std::move(works));
}

WorkHandle ProcessGroup::all_to_all_async(const std::vector<Tensor>& inputs, const std::vector<Tensor>& outputs) {
  const int n = size(), me = rank();
  ZG_CHECK(inputs.size() == outputs.size(), "all_to_all: ", inputs.size(), " inputs for ", outputs.size(), " outputs");
  std::vector<P2POp> ops;
  for (size_t t = 0; t < inputs.size(); ++t) {
    const Tensor &in = inputs[t], &out = outputs[t];
    ZG_CHECK(in.dim() == 1 && in.is_contiguous() && in.numel() % n == 0 && out.dim() == 1 && out.is_contiguous() &&
                 out.numel() == in.numel() && out.dtype() == in.dtype() && out.device() == in.device(),
             "all_to_all: input ", describe(in), " and output ", describe(out), " must be contiguous 1-D tensors alike, ",
             "of ", n, " equal chunks (one a rank of the ", kind(), " group)");
    const int64_t c = in.numel() / n;
    for (int peer = 0; peer < n; ++peer) {
      if (peer == me) continue;
      ops.push_back({P2POp::send, in.narrow(0, peer * c, c), peer, static_cast<int64_t>(t)});
      ops.push_back({P2POp::recv, out.narrow(0, peer * c, c), peer, static_cast<int64_t>(t)});
    }
    backend(in.device()).copy(in.narrow(0, me * c, c), out.narrow(0, me * c, c));
  }
  return batch_async(ops);
}

std::vector<WorkHandle> ProcessGroup::issue_p2p(std::vector<Collective>) {
  fail("send/recv: the ", kind(), " group has no point-to-point messages");
}

void ProcessGroup::barrier() { submit({CollectiveOp::barrier, Tensor(), Tensor(), ReduceKind::sum, 0})->wait(); }

}  // namespace zg::dist
