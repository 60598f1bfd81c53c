#include "dist/comm/nccl_group.h"

#include <nccl.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <functional>
#include <string>
#include <thread>


#include "autograd/functions.h"
#include "cuda/caching_allocator.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/stream.h"

namespace zg::dist {

namespace {

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f64: return ncclFloat64;
    case DType::f32: return ncclFloat32;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::i64: return ncclInt64;
    case DType::i32: return ncclInt32;
    case DType::i8: return ncclInt8;
    default: fail("nccl group: no NCCL type for ", name(dtype));
  }
}

ncclRedOp_t nccl_op(ReduceKind op) {
  switch (op) {
    case ReduceKind::sum: return ncclSum;
    case ReduceKind::average: return ncclAvg;
    case ReduceKind::max: return ncclMax;
  }
  return ncclSum;
}

using Clock = std::chrono::steady_clock;

}  // namespace

// The communicator and its watchdog.
//
// The communicator is non-blocking (NCCL's config.blocking = 0): no NCCL call waits for
// the other ranks. A call that needs them -- creating the communicator, a rank's first
// collective with a peer (NCCL connects lazily), finalizing -- returns ncclInProgress,
// and the caller polls until NCCL has settled it, for at most `timeout`. So no NCCL
// call can block for ever, whatever the other ranks do.
//
// Two locks, always taken in this order:
//   call   held around every NCCL call on `comm` -- ncclCommGetAsyncError included: NCCL
//          allows one thread at a time on a communicator -- until it has settled, and
//          around ncclCommAbort, so the communicator is never freed under a call
//   mutex  guards the state below; held briefly, never across an NCCL call
// `comm` itself changes only with `call` held.
// The watchdog looks every 50 ms: it drops finished work, and aborts the communicator
// when the oldest collective has been the oldest for longer than the timeout (a rank
// died or diverged: the kernel waits on the device for ever), on a CUDA error, or on an
// asynchronous NCCL error. Nothing may escape a thread's body (that would terminate the
// process), so every failure becomes `error`, which the training thread throws.
struct NcclGroup::Communicator {
  ncclComm_t comm = nullptr;  // null once aborted or destroyed
  int device = 0;
  std::chrono::milliseconds timeout{};
  std::mutex call;
  std::mutex mutex;
  std::condition_variable wake;
  struct Pending {
    std::shared_ptr<cuda::Event> done;  // recorded once NCCL has enqueued the collective
    std::atomic<bool> enqueued{false};  // ... which this says
    std::string what;
  };
  std::deque<std::shared_ptr<Pending>> pending;  // issued, not yet seen finished; oldest first
  const Pending* oldest = nullptr;               // pending.front() when the watchdog last looked
  Clock::time_point oldest_since;                // ... and since when it has been the oldest
  std::string error;                             // once set, every call on the group throws it
  bool stopping = false;
  std::thread watchdog;

  void throw_if_failed() {
    std::lock_guard lock(mutex);
    if (!error.empty()) throw Error(error);
  }

  // With `call` held: records the error, forgets the pending work, and aborts the
  // communicator (ending its calls and kernels in flight; the streams go on). The abort
  // runs outside `mutex`: it joins NCCL's threads, and waits go on failing meanwhile.
  void abort(const std::string& problem) {
    ncclComm_t aborted = nullptr;
    {
      std::lock_guard lock(mutex);
      if (error.empty()) error = problem;
      aborted = comm;
      comm = nullptr;
      pending.clear();
      oldest = nullptr;
      wake.notify_all();
    }
    if (aborted) ncclCommAbort(aborted);
  }

  // With `call` held, after a call on `comm` returned `result`: polls until NCCL has
  // settled it, for at most `timeout`. An error or the timeout aborts the communicator
  // and throws.
  void settle(ncclResult_t result, const std::string& what) {
    const Clock::time_point deadline = Clock::now() + timeout;
    while (result == ncclInProgress && comm) {
      if (Clock::now() > deadline) {
        const std::string problem = "nccl group: " + what + " did not finish within " +
                                    std::to_string(timeout.count()) + " ms (a rank is missing, failed or stuck)";
        abort(problem);
        throw Error(problem);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      ncclResult_t state = ncclSuccess;
      const ncclResult_t query = ncclCommGetAsyncError(comm, &state);
      result = query != ncclSuccess ? query : state;
    }
    if (result == ncclSuccess) return;
    const std::string problem = "nccl group: " + what + ": " + ncclGetErrorString(result) + ": " +
                                ncclGetLastError(nullptr);
    abort(problem);
    throw Error(problem);
  }

  // With `mutex` held: drops finished work; what is wrong on the device, or "".
  std::string overdue() {
    try {
      cuda::DeviceGuard guard(device);
      while (!pending.empty() && pending.front()->enqueued && pending.front()->done->query()) pending.pop_front();
      if (pending.empty()) {
        oldest = nullptr;
        wake.notify_all();  // a destructor may be waiting for this
        return "";
      }
      // Timed from when a collective became the oldest, not from its issue: the host
      // issues ahead of the device, and a queue of collectives is not a stuck one.
      if (pending.front().get() != oldest) {
        oldest = pending.front().get();
        oldest_since = Clock::now();
      }
      if (Clock::now() - oldest_since > timeout)
        return "nccl group: " + pending.front()->what + " did not finish within " + std::to_string(timeout.count()) +
               " ms (a rank failed, or called another collective)";
      return "";
    } catch (const std::exception& e) {
      return std::string("nccl group: ") + e.what();
    }
  }

  // With `call` held: NCCL's asynchronous error, or "".
  std::string async_error() {
    if (!comm) return "";
    ncclResult_t async = ncclSuccess;
    const ncclResult_t query = ncclCommGetAsyncError(comm, &async);
    if (query != ncclSuccess) async = query;
    if (async == ncclSuccess || async == ncclInProgress) return "";
    return std::string("nccl group: ") + ncclGetErrorString(async) + ": " + ncclGetLastError(nullptr);
  }

  void watch() {
    std::unique_lock lock(mutex);
    while (!stopping) {
      wake.wait_for(lock, std::chrono::milliseconds(50));
      if (!comm) continue;
      std::string found = overdue();
      if (!found.empty()) error = found;  // new calls are refused from here on
      lock.unlock();                      // the lock order is call, then mutex
      {
        std::unique_lock calling(call, std::defer_lock);
        if (!found.empty()) {
          calling.lock();  // waits for a call being issued to settle (bounded by its own timeout)
          abort(found);
        } else if (calling.try_lock()) {  // else a call is being issued, and it polls the same state
          found = async_error();
          if (!found.empty()) abort(found);
        }
      }
      lock.lock();
    }
  }
};

namespace {

// Waiting on the device: the caller's compute stream waits for `done`. A barrier
// also blocks the host, as a barrier must.
class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<cuda::Event> done, Device device, std::shared_ptr<NcclGroup::Communicator> communicator,
           bool block_host)
      : done_(std::move(done)), device_(device), communicator_(std::move(communicator)), block_host_(block_host) {}
  void wait() override {
    communicator_->throw_if_failed();
    cuda::DeviceGuard guard(device_.index);
    if (block_host_) done_->synchronize();
    else done_->block(cuda::current_stream(device_));
    communicator_->throw_if_failed();
  }
  bool completed() const override {
    cuda::DeviceGuard guard(device_.index);
    return done_->query();
  }

 private:
  std::shared_ptr<cuda::Event> done_;
  Device device_;
  std::shared_ptr<NcclGroup::Communicator> communicator_;
  bool block_host_;
};

}  // namespace

NcclId NcclGroup::unique_id() {
  ncclUniqueId id;
  ZG_NCCL_CHECK(ncclGetUniqueId(&id));
  NcclId bytes;
  std::memcpy(bytes.data(), &id, sizeof id);
  return bytes;
}

NcclGroup::NcclGroup(const NcclId& id, int rank, int size, Device device, ProcessGroup* host, NcclOptions options)
    : rank_(rank), size_(size), device_(device), host_(host), options_(options),
      communicator_(std::make_shared<Communicator>()) {
  ZG_CHECK(device.type == DeviceType::cuda, "nccl group: needs a cuda device, got ", device.str());
  ZG_CHECK(size >= 1 && rank >= 0 && rank < size, "nccl group: rank ", rank, " of ", size, " is not valid");
  ZG_CHECK(!host || (host->rank() == rank && host->size() == size), "nccl group: the host group is rank ",
           host ? host->rank() : 0, " of ", host ? host->size() : 0, ", this group rank ", rank, " of ", size);
  static_assert(sizeof(ncclUniqueId) == std::tuple_size_v<NcclId>);
  ncclUniqueId nccl_id;
  std::memcpy(&nccl_id, id.data(), sizeof nccl_id);
  cuda::DeviceGuard guard(device.index);
  Communicator& c = *communicator_;
  c.device = device.index;
  c.timeout = checked_timeout("nccl group", options.timeout);
  if (const char* blocking = std::getenv("NCCL_COMM_BLOCKING"); blocking && std::string(blocking) != "0")
    std::fprintf(stderr, "zerograd: NCCL_COMM_BLOCKING=%s makes NCCL calls block again; the nccl group's timeouts "
                 "then cover only collectives already on the device\n", blocking);
  {
    // Creating it waits for every rank: non-blocking, so a rank that never arrives ends
    // this one with an error after the timeout instead of leaving it here for ever.
    std::lock_guard calling(c.call);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t result = ncclCommInitRankConfig(&c.comm, size, nccl_id, rank, &config);
    ZG_CHECK(c.comm != nullptr || result == ncclSuccess, "nccl group: rank ", rank, " of ", size,
             ": ncclCommInitRankConfig failed: ", ncclGetErrorString(result), ": ", ncclGetLastError(nullptr));
    c.settle(result, "creating the communicator (rank " + std::to_string(rank) + " of " + std::to_string(size) + ")");
  }
  c.watchdog = std::thread([&c] { c.watch(); });
  sent_.resize(static_cast<size_t>(size)), received_.resize(static_cast<size_t>(size));
  if (host && options.check_calls) answers_ = host->split(0, rank);  // a collective, as this constructor is
}

NcclGroup::~NcclGroup() {
  Communicator& c = *communicator_;
  {
    // Issued work finishes first -- or the watchdog aborts it after the timeout -- so
    // finalizing below cannot wait forever for a rank that is gone.
    std::unique_lock lock(c.mutex);
    c.wake.wait(lock, [&] { return c.pending.empty() || !c.comm; });
    c.stopping = true;
  }
  c.wake.notify_all();
  c.watchdog.join();
  std::lock_guard calling(c.call);
  if (!c.comm) return;
  cuda::DeviceGuard guard(device_.index);
  try {
    // Finalizing flushes issued work and waits for the other ranks to be done with this
    // one: settled with the timeout, like every call; on failure it was aborted instead.
    c.settle(ncclCommFinalize(c.comm), "finalizing the communicator");
    ncclCommDestroy(c.comm);
    c.comm = nullptr;
  } catch (const std::exception&) {
    // A destructor reports nothing; the communicator is aborted and its resources freed.
  }
}

void NcclGroup::agree(const Collective& collective) {
  const Collective::Signature signature = collective.signature();
  MemoryScope scope(MemoryCategory::communication);
  const Tensor mine = tensor(std::vector<int64_t>(signature.begin(), signature.end()));
  const Tensor all = empty({mine.numel() * size_}, DType::i64);
  CollectiveTag untagged(0);  // the tag is in the signature; the exchange itself is not the caller's call
  host_->all_gather(mine, all);
  const std::vector<int64_t> values = all.to_vector<int64_t>();
  std::vector<Collective::Signature> signatures(size_);
  for (int q = 0; q < size_; ++q)
    std::copy_n(values.begin() + q * signature.size(), signature.size(), signatures[q].begin());
  if (std::string problem = Collective::mismatch(signatures, calls_++, "nccl group"); !problem.empty())
    fail(problem);
}

// What enqueue puts on the communication stream.
struct NcclGroup::Launch {
  std::string what;              // for errors: the collective, or the batch of messages
  std::vector<Tensor> buffers;   // used on the communication stream until it is done
  std::function<ncclResult_t(ncclComm_t, cudaStream_t)> calls;
  bool block_host = false;       // a barrier's wait blocks the host too
};

WorkHandle NcclGroup::issue(Collective c) {
  for (const Tensor* t : {&c.input, &c.output})
    ZG_CHECK(!t->defined() || (t->device() == device_ && t->is_contiguous()), "nccl group: ", name(c.op),
             " needs contiguous tensors on ", device_.str(), ", got ", describe(*t));
  if (host_ && options_.check_calls) agree(c);
  if (c.op == CollectiveOp::barrier) {  // a one-element all-reduce that every rank must reach
    MemoryScope scope(MemoryCategory::communication);
    cuda::DeviceGuard guard(device_.index);
    c.input = c.output = zeros({1}, TensorOptions(DType::f32).device(device_));
  }
  const ncclDataType_t type = nccl_type(c.input.dtype());
  void* out = c.output.data_ptr();
  const void* in = c.input.data_ptr();
  const auto calls = [c, type, in, out](ncclComm_t comm, cudaStream_t stream) {
    switch (c.op) {
      case CollectiveOp::all_reduce:
      case CollectiveOp::barrier: return ncclAllReduce(in, out, c.input.numel(), type, nccl_op(c.reduce), comm, stream);
      case CollectiveOp::reduce_scatter:
        return ncclReduceScatter(in, out, c.output.numel(), type, nccl_op(c.reduce), comm, stream);
      case CollectiveOp::all_gather: return ncclAllGather(in, out, c.input.numel(), type, comm, stream);
      case CollectiveOp::broadcast: return ncclBroadcast(in, out, c.input.numel(), type, c.root, comm, stream);
      case CollectiveOp::send:
      case CollectiveOp::recv: break;  // messages: issue_p2p
    }
    return ncclInvalidUsage;
  };
  return enqueue({c.describe(), {c.input, c.output}, calls, c.op == CollectiveOp::barrier});
}

// Each message's signature goes to its peer -- a send's over host_, a receive's answer
// over answers_, so that host_'s channel from a to b carries only a's sends' calls and
// answers_' only b's receives' -- and each end compares the pair.
void NcclGroup::agree_p2p(const std::vector<Collective>& messages) {
  MemoryScope scope(MemoryCategory::communication);
  CollectiveTag untagged(0);
  std::vector<P2POp> offers, answers;
  std::vector<Tensor> theirs;
  for (const Collective& m : messages) {
    const Collective::Signature signature = m.signature();
    const Tensor mine = tensor(std::vector<int64_t>(signature.begin(), signature.end()));
    theirs.push_back(empty({mine.numel()}, DType::i64));
    const bool sending = m.op == CollectiveOp::send;
    (sending ? offers : answers).push_back({P2POp::send, mine, m.root, 0});
    (sending ? answers : offers).push_back({P2POp::recv, theirs.back(), m.root, 0});
  }
  host_->batch_async(offers)->wait();
  answers_->batch_async(answers)->wait();
  for (size_t i = 0; i < messages.size(); ++i) {
    const Collective& m = messages[i];
    const std::vector<int64_t> values = theirs[i].to_vector<int64_t>();
    Collective::Signature other;
    std::copy(values.begin(), values.end(), other.begin());
    const bool sending = m.op == CollectiveOp::send;
    const int64_t index = (sending ? sent_ : received_)[static_cast<size_t>(m.root)]++;
    if (std::string problem = Collective::p2p_mismatch(sending ? m.signature() : other, sending ? other : m.signature(),
                                                       sending ? rank_ : m.root, sending ? m.root : rank_, index,
                                                       "nccl group");
        !problem.empty())
      fail(problem);
  }
}

std::vector<WorkHandle> NcclGroup::issue_p2p(std::vector<Collective> messages) {
  std::string what = messages.size() == 1 ? messages[0].describe() : "a batch of " + std::to_string(messages.size()) +
                                                                          " messages from " + messages[0].describe();
  std::vector<Tensor> buffers;
  for (const Collective& m : messages) {
    ZG_CHECK(m.input.device() == device_, "nccl group: ", m.describe(), " needs a tensor on ", device_.str());
    buffers.push_back(m.input);
  }
  if (host_ && options_.check_calls) agree_p2p(messages);
  const auto calls = [messages](ncclComm_t comm, cudaStream_t stream) {
    ncclResult_t result = ncclGroupStart();
    for (const Collective& m : messages) {
      if (result != ncclSuccess) break;
      const Tensor& t = m.input;
      result = m.op == CollectiveOp::send ? ncclSend(t.data_ptr(), t.numel(), nccl_type(t.dtype()), m.root, comm, stream)
                                          : ncclRecv(t.data_ptr(), t.numel(), nccl_type(t.dtype()), m.root, comm, stream);
    }
    const ncclResult_t ended = ncclGroupEnd();
    return result != ncclSuccess ? result : ended;
  };
  WorkHandle work = enqueue({std::move(what), std::move(buffers), calls, false});
  return std::vector<WorkHandle>(messages.size(), work);
}

// The inputs are complete where the compute stream is now: the communication stream
// waits for that, runs the NCCL calls and records `done`.
WorkHandle NcclGroup::enqueue(const Launch& launch) {
  communicator_->throw_if_failed();
  cuda::DeviceGuard guard(device_.index);
  const cudaStream_t compute = cuda::current_stream(device_), comm_stream = cuda::communication_stream(device_);
  cuda::Event ready;
  ready.record(compute);
  ready.block(comm_stream);
  auto pending = std::make_shared<Communicator::Pending>();
  pending->done = std::make_shared<cuda::Event>();
  pending->what = launch.what;
  Communicator& k = *communicator_;
  std::lock_guard calling(k.call);
  {
    std::lock_guard lock(k.mutex);
    ZG_CHECK(k.error.empty() && k.comm, k.error.empty() ? "nccl group: the communicator is gone" : k.error);
    k.pending.push_back(pending);
  }
  // Until it settles the call may not be on the stream yet (a first call connects to its
  // peers). A failure aborts the communicator: every rank then fails.
  k.settle(launch.calls(k.comm, comm_stream), pending->what);
  try {
    pending->done->record(comm_stream);
  } catch (...) {  // no event to wait for: forget it, or the destructor would wait a timeout for it
    std::lock_guard lock(k.mutex);
    std::erase(k.pending, pending);
    throw;
  }
  pending->enqueued = true;
  // Freed by the caller before the call ends, these blocks wait for it before reuse.
  for (size_t i = 0; i < launch.buffers.size(); ++i)
    if (i == 0 || !launch.buffers[i].is_same(launch.buffers[i - 1])) cuda::record_stream(launch.buffers[i], comm_stream);
  return std::make_shared<NcclWork>(pending->done, device_, communicator_, launch.block_host);
}

}  // namespace zg::dist
