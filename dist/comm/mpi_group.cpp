#include "dist/comm/mpi_group.h"

#include <mpi.h>

#include <climits>
#include <cstring>
#include <thread>

#include "autograd/functions.h"
#include "tensor/backend.h"

namespace zg::dist {

namespace {

void check(int status, const char* call) {
  if (status == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(status, text, &length);
  fail("mpi group: ", call, " failed: ", std::string(text, static_cast<size_t>(length)));
}

// Reductions run in f32 for the 16-bit floats (MPI has no type for them), in place
// otherwise. So a bf16 sum is rounded once here, where the local and nccl groups round
// after each rank's add: they can differ in the last bit.
MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::f64: return MPI_DOUBLE;
    case DType::f32: return MPI_FLOAT;
    case DType::i64: return MPI_INT64_T;
    case DType::i32: return MPI_INT32_T;
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

// True once MPI has completed `request`, false when `timeout` passed first. A
// non-blocking collective progresses only inside MPI calls (OpenMPI runs no progress
// thread), so it is tested without pause for the first 200 us -- a collective whose peers
// are all there ends within that -- then every 100 us, leaving the core to the rank's
// compute while a late peer is awaited.
bool completes(MPI_Request& request, std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  for (;;) {
    int done = 0;
    check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test");
    if (done) return true;
    const Clock::duration waited = Clock::now() - start;
    if (waited > timeout) return false;
    if (waited > std::chrono::microseconds(200)) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

}  // namespace

MpiGroup::MpiGroup(MpiOptions options) : timeout_(checked_timeout("mpi group", options.timeout)) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
    // Collectives run on the group's communication worker thread, not the main thread.
    ZG_CHECK(provided >= MPI_THREAD_SERIALIZED, "mpi group: this MPI provides thread level ", provided,
             ", below MPI_THREAD_SERIALIZED");
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  check(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(MPI_COMM_WORLD, &size_), "MPI_Comm_size");
}

void MpiGroup::finalize() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Finalize();
}

void MpiGroup::time_out(const char* what, const Collective& c, std::shared_ptr<void> keep) {
  // MPI may still complete the abandoned call and write these buffers: they are never freed.
  new std::shared_ptr<void>(std::move(keep));  // NOLINT: leaked on purpose
  broken_ = "mpi group: " + std::string(what) + " for " + c.describe() + " (collective #" +
            std::to_string(calls_ - 1) + ") did not finish within " + std::to_string(timeout_.count()) +
            " ms: a rank is missing, failed or stuck. MPI cannot cancel a collective, so the group is unusable: "
            "end the process (mpirun then ends the other ranks)";
  fail(broken_);
}

// Every rank's call, all-gathered as a signature and compared before any data moves.
void MpiGroup::agree(const Collective& c) {
  using Signatures = std::vector<Collective::Signature>;
  auto all = std::make_shared<Signatures>(size_ + 1);  // [0, size): every rank's; [size]: this rank's
  (*all)[size_] = c.signature();
  const int n = static_cast<int>((*all)[size_].size());
  ++calls_;
  MPI_Request request;
  check(MPI_Iallgather((*all)[size_].data(), n, MPI_INT64_T, all->data(), n, MPI_INT64_T, MPI_COMM_WORLD, &request),
        "MPI_Iallgather (call check)");
  if (!completes(request, timeout_)) time_out("MPI_Iallgather (call check)", c, all);
  all->pop_back();
  if (std::string problem = Collective::mismatch(*all, calls_ - 1, "mpi group"); !problem.empty()) fail(problem);
}

// Scratch buffers are allocated before the ranks agree on the call: a rank that runs
// out of memory fails before the others post anything, so it can free memory and call
// again in step. After agree(), a failing rank should exit, and mpirun ends the others.
void MpiGroup::run(const Collective& c) {
  ZG_CHECK(broken_.empty(), broken_, " (refusing ", c.describe(), ")");
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
  switch (c.op) {
    case CollectiveOp::all_reduce:
      call = "MPI_Iallreduce";
      check(MPI_Iallreduce(MPI_IN_PLACE, send.data_ptr(), count, mpi_type(send.dtype()), mpi_op(c.reduce),
                           MPI_COMM_WORLD, &request),
            call);
      break;
    case CollectiveOp::reduce_scatter:
      call = "MPI_Ireduce_scatter_block";
      check(MPI_Ireduce_scatter_block(send.data_ptr(), result.data_ptr(), count, mpi_type(send.dtype()),
                                      mpi_op(c.reduce), MPI_COMM_WORLD, &request),
            call);
      break;
    case CollectiveOp::all_gather: {
      call = "MPI_Iallgather";
      const bool in_place =
          c.input.storage() == c.output.storage() && c.input.offset() == c.output.offset() + rank_ * c.input.numel();
      check(MPI_Iallgather(in_place ? MPI_IN_PLACE : c.input.data_ptr(), in_place ? 0 : bytes, MPI_BYTE,
                           c.output.data_ptr(), bytes, MPI_BYTE, MPI_COMM_WORLD, &request),
            call);
      break;
    }
    case CollectiveOp::broadcast:
      call = "MPI_Ibcast";
      check(MPI_Ibcast(c.input.data_ptr(), bytes, MPI_BYTE, c.root, MPI_COMM_WORLD, &request), call);
      break;
    case CollectiveOp::barrier:
      call = "MPI_Ibarrier";
      check(MPI_Ibarrier(MPI_COMM_WORLD, &request), call);
      break;
  }
  if (!completes(request, timeout_))
    time_out(call, c, std::make_shared<std::vector<Tensor>>(std::vector<Tensor>{c.input, c.output, send, result}));
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
