#include "dist/comm/mpi_group.h"

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <memory>
#include <cstring>
#include <thread>

#include "autograd/functions.h"
#include "dist/comm/mpi_process.h"
#include "tensor/backend.h"

namespace zg::dist {

void check_mpi(int status, const char* call) {
  if (status == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(status, text, &length);
  fail("mpi group: ", call, " failed: ", std::string(text, static_cast<size_t>(length)));
}

namespace {

// Reductions run in f32 for the 16-bit floats (MPI has no type for them), in place
// otherwise. So a bf16 sum is rounded once here, where the local and nccl groups round
// after each rank's add: they can differ in the last bit.
MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::f64: return MPI_DOUBLE;
    case DType::f32: return MPI_FLOAT;
    case DType::i64: return MPI_INT64_T;
    case DType::i32: return MPI_INT32_T;
    case DType::i8: return MPI_INT8_T;
    default: fail("mpi group: no MPI reduction for ", name(dtype));
  }
}

bool is_16bit(DType d) { return d == DType::f16 || d == DType::bf16; }

// t itself, or for 16-bit floats an f32 copy: what MPI reduces.
Tensor widened(const Tensor& t) {
  if (!is_16bit(t.dtype())) return t;
  MemoryScope scope(MemoryCategory::communication);
  Tensor wide = empty(t.shape(), TensorOptions(DType::f32));
  backend(kCPU).copy(t, wide);
  return wide;
}

void check_cpu(const char* op, const Tensor& t) {
  ZG_CHECK(t.device() == kCPU && t.is_contiguous(), "mpi group: ", op, " needs contiguous CPU tensors, got ",
           zg::describe(t));
}

void scale(const Tensor& t, ReduceKind op, int size) {
  if (op == ReduceKind::average) scale_buffer(t, 1.0 / size);
}

MPI_Op mpi_op(ReduceKind op) { return op == ReduceKind::max ? MPI_MAX : MPI_SUM; }

// Failure notices travel on their own communicator with these tags: a notice (the
// failing rank's message) and its acknowledgement.
constexpr int kNoticeTag = 1, kAckTag = 2;
// The call check's messages, on the group's own communicator.
constexpr int kCallTag = 3;
constexpr int kMaxNoticeBytes = 4096;

// The notice `status` found on `notices`, received.
std::string receive_notice(const MPI_Status& status, MPI_Comm notices) {
  int bytes = 0;
  MPI_Get_count(&status, MPI_CHAR, &bytes);
  std::string notice(static_cast<size_t>(std::clamp(bytes, 0, kMaxNoticeBytes)), '\0');
  check_mpi(MPI_Recv(notice.data(), static_cast<int>(notice.size()), MPI_CHAR, status.MPI_SOURCE, kNoticeTag, notices,
                 MPI_STATUS_IGNORE),
        "MPI_Recv (failure notice)");
  return notice;
}

}  // namespace

MpiGroup::MpiGroup(MpiOptions options) : timeout_(checked_timeout("mpi group", options.timeout)) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
    // Collectives run on the group's communication worker thread, not the main thread.
    ZG_CHECK(provided >= MPI_THREAD_SERIALIZED, "mpi group: this MPI provides thread level ", provided,
             ", below MPI_THREAD_SERIALIZED");
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &size_), "MPI_Comm_size");
  comm_ = MPI_Comm_c2f(MPI_COMM_WORLD);
  process_ = std::make_shared<MpiProcess>();
  process_->rank = rank_, process_->size = size_;
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &process_->notices), "MPI_Comm_dup");
}

MpiGroup::MpiGroup(std::shared_ptr<MpiProcess> process, int comm, std::chrono::milliseconds timeout)
    : process_(std::move(process)), comm_(comm), timeout_(timeout) {
  check_mpi(MPI_Comm_rank(MPI_Comm_f2c(comm_), &rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_Comm_f2c(comm_), &size_), "MPI_Comm_size");
}

// A split's communicator is left to MPI_Finalize: MPI_Comm_free is a collective, and a
// group destroyed while its rank fails must not wait for the others.
MpiGroup::~MpiGroup() { stop_worker(); }

// Every rank reached split() (ProcessGroup::split's all-gather): MPI_Comm_split, blocking, returns promptly.
std::unique_ptr<ProcessGroup> MpiGroup::subgroup(const std::vector<int>&, int color, int key) {
  MPI_Comm comm = MPI_COMM_NULL;
  {
    std::lock_guard<std::mutex> lock(process_->mpi);
    ZG_CHECK(process_->broken.empty(), process_->broken, " (refusing split)");
    check_mpi(MPI_Comm_split(MPI_Comm_f2c(comm_), color, key, &comm), "MPI_Comm_split");
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  }
  return std::unique_ptr<ProcessGroup>(new MpiGroup(process_, MPI_Comm_c2f(comm), timeout_));
}

void MpiGroup::finalize() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Finalize();
}

void MpiGroup::give_up(std::string why, std::shared_ptr<void> keep) {
  // MPI may still complete the abandoned call and write these buffers: they are never freed.
  new std::shared_ptr<void>(std::move(keep));  // NOLINT: leaked on purpose
  std::lock_guard<std::mutex> lock(process_->mpi);
  if (process_->broken.empty()) process_->broken = std::move(why);
  fail(process_->broken);
}

void MpiGroup::time_out(const char* what, const Collective& c, const std::string& stuck, std::shared_ptr<void> keep) {
  give_up("mpi group: " + std::string(what) + " for " + c.describe() + " (collective #" + std::to_string(calls_ - 1) +
              ") did not finish within " + std::to_string(timeout_.count()) + " ms " + stuck +
              ". MPI cannot cancel a collective, so the group is unusable: end the process (mpirun then ends the "
              "other ranks)",
          std::move(keep));
}

bool MpiGroup::completes(void* request_ptrs, int count, const Collective& c, const std::shared_ptr<void>& keep) {
  MPI_Request* requests = static_cast<MPI_Request*>(request_ptrs);
  return polls(
      [&] {
        int done = 0;
        check_mpi(MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE), "MPI_Testall");
        return done != 0;
      },
      c.describe() + ", collective #" + std::to_string(calls_ - 1), keep);
}

// A non-blocking collective progresses only inside MPI calls (OpenMPI runs no progress
// thread), so it is tested without pause for the first 200 us -- a collective whose peers
// are all there ends within that -- then every 100 us, leaving the core to the rank's
// compute while a late peer is awaited. Each test also looks for a failure notice; once one
// came, the collective has 200 ms more to finish, since a notice can overtake what its
// sender sent before failing (MPI orders messages within one communicator only). Every
// test also moves the process's posted messages on (mpi_p2p.cpp).
bool MpiGroup::polls(const std::function<bool()>& done, const std::string& what, const std::shared_ptr<void>& keep) {
  using Clock = std::chrono::steady_clock;
  MpiProcess& p = *process_;
  const Clock::time_point start = Clock::now();
  for (;;) {
    std::string notice;
    int sender = -1;
    {
      std::lock_guard<std::mutex> lock(p.mpi);
      ZG_CHECK(p.broken.empty(), p.broken, " (abandoning ", what, ")");  // fail_others ran meanwhile
      progress_messages(p);
      if (done()) return true;
      int arrived = 0;
      MPI_Status status;
      if (p.notified_by < 0) check_mpi(MPI_Iprobe(MPI_ANY_SOURCE, kNoticeTag, p.notices, &arrived, &status), "MPI_Iprobe");
      if (arrived) {
        p.notice = receive_notice(status, p.notices);
        p.notified_by = status.MPI_SOURCE;  // acknowledged by fail_others, once this rank has reported it
        p.noticed = Clock::now();
      }
      if (p.notified_by >= 0 && Clock::now() - p.noticed > std::chrono::milliseconds(200))
        sender = p.notified_by, notice = p.notice;
    }
    if (sender >= 0)
      give_up("mpi group: rank " + std::to_string(sender) + " failed: " + notice + " (this rank was in " + what +
                  ", which cannot finish)",
              keep);
    const Clock::duration waited = Clock::now() - start;
    if (waited > timeout_) return false;
    if (waited > std::chrono::microseconds(200)) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void MpiGroup::fail_others(const std::string& message) {
  using Clock = std::chrono::steady_clock;
  MpiProcess& p = *process_;
  const MPI_Comm notices = p.notices;
  const std::string text = message.substr(0, kMaxNoticeBytes);
  std::vector<MPI_Request> sends, acks;
  std::vector<char> ack_bytes(static_cast<size_t>(p.size));
  const char ack = 1;
  {
    std::lock_guard<std::mutex> lock(p.mpi);
    if (p.notified_by >= 0) {  // failed because another rank did: tell that one it was heard
      MPI_Send(&ack, 1, MPI_CHAR, p.notified_by, kAckTag, notices);
      return;
    }
    if (p.broken.empty()) p.broken = "mpi group: this rank failed (" + message.substr(0, 200) + ") and told the others";
    for (int q = 0; q < p.size; ++q) {
      if (q == p.rank) continue;
      sends.emplace_back();
      acks.emplace_back();
      MPI_Isend(text.data(), static_cast<int>(text.size()), MPI_CHAR, q, kNoticeTag, notices, &sends.back());
      MPI_Irecv(&ack_bytes[static_cast<size_t>(q)], 1, MPI_CHAR, q, kAckTag, notices, &acks.back());
    }
  }
  // The others acknowledge from the collective they wait in; one that computes for long
  // reads the notice at its next collective, after this rank has gone.
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(5);
  while (Clock::now() < deadline) {
    int all = 0;
    {
      std::lock_guard<std::mutex> lock(p.mpi);
      MPI_Testall(static_cast<int>(acks.size()), acks.data(), &all, MPI_STATUSES_IGNORE);
      // Another rank failing at the same time waits for this one's word too.
      int arrived = 0;
      MPI_Status status;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kNoticeTag, notices, &arrived, &status) == MPI_SUCCESS && arrived) {
        receive_notice(status, notices);
        MPI_Send(&ack, 1, MPI_CHAR, status.MPI_SOURCE, kAckTag, notices);
      }
    }
    if (all) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

int run_mpi(const std::function<void(ProcessGroup&)>& fn, MpiOptions options) {
  std::unique_ptr<MpiGroup> group;
  try {
    group = std::make_unique<MpiGroup>(options);
    fn(*group);
    group->barrier();
  } catch (const std::exception& e) {
    // Reported before the others hear of it (fail_others): once they have, mpirun may end this process.
    std::fprintf(stderr, "rank %d: %s\n", group ? group->rank() : -1, e.what());
    std::fflush(stderr);
    if (group) group->fail_others(e.what());
    return 1;  // without finalize: the others may still be in collectives with this rank
  }
  group.reset();
  MpiGroup::finalize();
  return 0;
}

// Every rank's call, as a signature, sent to every other rank and compared before any data
// moves. Point to point rather than an all-gather: at the timeout, the receives still
// pending name the ranks that never came (in the order posted: a rank's messages to
// another arrive in order, so collective #k's meet #k's).
void MpiGroup::agree(const Collective& c) {
  using Signatures = std::vector<Collective::Signature>;
  auto all = std::make_shared<Signatures>(size_);
  (*all)[rank_] = c.signature();
  const int n = static_cast<int>((*all)[rank_].size());
  ++calls_;
  std::vector<MPI_Request> requests(2 * static_cast<size_t>(size_ - 1));  // receives, in rank order; then sends
  const MPI_Comm comm = MPI_Comm_f2c(comm_);
  {
    std::lock_guard<std::mutex> lock(process_->mpi);
    for (int q = 0, i = 0; q < size_; ++q) {
      if (q == rank_) continue;
      check_mpi(MPI_Irecv((*all)[q].data(), n, MPI_INT64_T, q, kCallTag, comm, &requests[i]), "MPI_Irecv (call check)");
      check_mpi(MPI_Isend((*all)[rank_].data(), n, MPI_INT64_T, q, kCallTag, comm, &requests[size_ - 1 + i++]),
            "MPI_Isend (call check)");
    }
  }
  if (!completes(requests.data(), static_cast<int>(requests.size()), c, all)) {
    std::string missing;
    {
      std::lock_guard<std::mutex> lock(process_->mpi);
      for (int q = 0, i = 0; q < size_; ++q) {
        if (q == rank_) continue;
        int done = 0;
        MPI_Test(&requests[i++], &done, MPI_STATUS_IGNORE);
        if (!done) missing += (missing.empty() ? "" : ", ") + std::to_string(q);
      }
    }
    time_out("the call check", c, "waiting for rank(s) " + missing + " of the group (missing, failed or stuck)", all);
  }
  if (std::string problem = Collective::mismatch(*all, calls_ - 1, "mpi group"); !problem.empty()) fail(problem);
}

// Scratch buffers are allocated before the ranks agree on the call: a rank that runs
// out of memory fails before the others post anything, so it can free memory and call
// again in step. After agree(), a failing rank should exit, and mpirun ends the others.
void MpiGroup::run(const Collective& c) {
  {
    std::lock_guard<std::mutex> lock(process_->mpi);
    ZG_CHECK(process_->broken.empty(), process_->broken, " (refusing ", c.describe(), ")");
  }
  for (const Tensor* t : {&c.input, &c.output})
    if (t->defined()) check_cpu(name(c.op), *t);
  // MPI counts are ints: per rank, at most 2^31 - 1 elements (reductions) or bytes (the rest).
  const auto count_of = [&](int64_t n, const char* of) {
    ZG_CHECK(n <= INT_MAX, "mpi group: ", c.describe(), " moves ", n, " ", of,
             " per rank, over MPI's count limit of 2^31 - 1; use smaller units or buckets");
    return static_cast<int>(n);
  };
  const bool reduces = c.op == CollectiveOp::all_reduce || c.op == CollectiveOp::reduce_scatter;
  // What MPI reduces (the input, widened to f32 for 16-bit floats) and where a
  // reduce-scatter lands before the copy into the output.
  const Tensor send = reduces ? widened(c.input) : c.input;
  Tensor result;
  if (c.op == CollectiveOp::reduce_scatter) {
    MemoryScope scope(MemoryCategory::communication);
    result = empty(c.output.shape(), TensorOptions(send.dtype()));
  }
  const bool moves_bytes = c.op == CollectiveOp::all_gather || c.op == CollectiveOp::broadcast;
  const int count = moves_bytes ? 0 : count_of(c.output.defined() ? c.output.numel() : 0, "elements");
  const int bytes = moves_bytes ? count_of(c.input.nbytes(), "bytes") : 0;
  agree(c);
  // Issue the call, then wait for it within the timeout.
  MPI_Request request;
  const char* call = "";
  const MPI_Comm comm = MPI_Comm_f2c(comm_);
  std::unique_lock<std::mutex> lock(process_->mpi);
  switch (c.op) {
    case CollectiveOp::all_reduce:
      call = "MPI_Iallreduce";
      check_mpi(MPI_Iallreduce(MPI_IN_PLACE, send.data_ptr(), count, mpi_type(send.dtype()), mpi_op(c.reduce),
                           comm, &request),
            call);
      break;
    case CollectiveOp::reduce_scatter:
      call = "MPI_Ireduce_scatter_block";
      check_mpi(MPI_Ireduce_scatter_block(send.data_ptr(), result.data_ptr(), count, mpi_type(send.dtype()),
                                      mpi_op(c.reduce), comm, &request),
            call);
      break;
    case CollectiveOp::all_gather: {
      call = "MPI_Iallgather";
      const bool in_place =
          c.input.storage() == c.output.storage() && c.input.offset() == c.output.offset() + rank_ * c.input.numel();
      check_mpi(MPI_Iallgather(in_place ? MPI_IN_PLACE : c.input.data_ptr(), in_place ? 0 : bytes, MPI_BYTE,
                           c.output.data_ptr(), bytes, MPI_BYTE, comm, &request),
            call);
      break;
    }
    case CollectiveOp::broadcast:
      call = "MPI_Ibcast";
      check_mpi(MPI_Ibcast(c.input.data_ptr(), bytes, MPI_BYTE, c.root, comm, &request), call);
      break;
    case CollectiveOp::barrier:
      call = "MPI_Ibarrier";
      check_mpi(MPI_Ibarrier(comm, &request), call);
      break;
    case CollectiveOp::send:  // messages are posted, not queued (mpi_p2p.cpp)
    case CollectiveOp::recv: fail("mpi group: ", c.describe(), " reached the collective queue");
  }
  lock.unlock();
  const auto buffers = std::make_shared<std::vector<Tensor>>(std::vector<Tensor>{c.input, c.output, send, result});
  if (!completes(&request, 1, c, buffers))
    time_out(call, c, "after every rank passed the call check (one failed or is stuck inside MPI, which cannot tell which)",
             buffers);
  // The reductions' last steps: the average's division, and the copy out of f32.
  if (c.op == CollectiveOp::all_reduce) {
    scale(send, c.reduce, size_);
    if (!send.is_same(c.input)) backend(kCPU).copy(send, c.input);
  } else if (c.op == CollectiveOp::reduce_scatter) {
    scale(result, c.reduce, size_);
    backend(kCPU).copy(result, c.output);
  }
}

}  // namespace zg::dist
