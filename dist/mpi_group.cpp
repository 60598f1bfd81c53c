#include "dist/mpi_group.h"

#include <mpi.h>

#include <cstdlib>
#include <cstring>

#include "tensor/backend.h"
#include "tensor/ops.h"

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

}  // namespace

MpiGroup::MpiGroup() {
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

bool MpiGroup::launched_by_mpirun() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
}

// Every rank's call, all-gathered as a signature and compared before any data moves.
void MpiGroup::agree(const Collective& c) {
  const Collective::Signature mine = c.signature();
  std::vector<Collective::Signature> all(size_);
  check(MPI_Allgather(mine.data(), mine.size(), MPI_INT64_T, all.data(), mine.size(), MPI_INT64_T, MPI_COMM_WORLD),
        "MPI_Allgather (call check)");
  if (std::string problem = Collective::mismatch(all, calls_++, "mpi group"); !problem.empty()) fail(problem);
}

// Scratch buffers are allocated before the ranks agree on the call: a rank that runs
// out of memory fails before the others post anything, so it can free memory and call
// again in step. After agree(), a failing rank exits and mpirun ends the others.
void MpiGroup::run(const Collective& c) {
  for (const Tensor* t : {&c.input, &c.output})
    if (t->defined()) check_cpu(name(c.op), *t);
  const bool reduces = c.op == CollectiveOp::all_reduce || c.op == CollectiveOp::reduce_scatter;
  // What MPI reduces (the input, widened to f32 for 16-bit floats) and where a
  // reduce-scatter lands before the copy into the output.
  const Tensor send = reduces ? widened(c.input) : c.input;
  Tensor result;
  if (c.op == CollectiveOp::reduce_scatter) {
    MemoryScope scope(MemoryCategory::communication);
    result = empty(c.output.shape(), TensorOptions(send.dtype()));
  }
  agree(c);
  const int count = static_cast<int>(c.output.defined() ? c.output.numel() : 0);
  switch (c.op) {
    case CollectiveOp::all_reduce:
      check(MPI_Allreduce(MPI_IN_PLACE, send.data_ptr(), count, mpi_type(send.dtype()), mpi_op(c.reduce),
                          MPI_COMM_WORLD),
            "MPI_Allreduce");
      scale(send, c.reduce, size_);
      if (!send.is_same(c.input)) backend(kCPU).copy(send, c.input);
      return;
    case CollectiveOp::reduce_scatter:
      check(MPI_Reduce_scatter_block(send.data_ptr(), result.data_ptr(), count, mpi_type(send.dtype()),
                                     mpi_op(c.reduce), MPI_COMM_WORLD),
            "MPI_Reduce_scatter_block");
      scale(result, c.reduce, size_);
      backend(kCPU).copy(result, c.output);
      return;
    case CollectiveOp::all_gather: {
      const int bytes = static_cast<int>(c.input.nbytes());
      const bool in_place =
          c.input.storage() == c.output.storage() && c.input.offset() == c.output.offset() + rank_ * c.input.numel();
      check(MPI_Allgather(in_place ? MPI_IN_PLACE : c.input.data_ptr(), in_place ? 0 : bytes, MPI_BYTE,
                          c.output.data_ptr(), bytes, MPI_BYTE, MPI_COMM_WORLD),
            "MPI_Allgather");
      return;
    }
    case CollectiveOp::broadcast:
      check(MPI_Bcast(c.input.data_ptr(), static_cast<int>(c.input.nbytes()), MPI_BYTE, c.root, MPI_COMM_WORLD),
            "MPI_Bcast");
      return;
    case CollectiveOp::barrier: check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier"); return;
  }
}

}  // namespace zg::dist
