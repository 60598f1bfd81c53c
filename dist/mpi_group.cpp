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

// What a rank calls, as plain bytes every rank can compare.
struct Descriptor {
  char op[16];
  int32_t reduce, root;
  int32_t in_dtype, out_dtype;  // -1: none
  int64_t in_numel, out_numel;
};

std::string describe(const Descriptor& d) {
  auto side = [](int32_t dtype, int64_t n) {
    return dtype < 0 ? std::string("-") : std::string(name(static_cast<DType>(dtype))) + "[" + std::to_string(n) + "]";
  };
  std::string s = std::string(d.op) + "(" + side(d.in_dtype, d.in_numel);
  if (d.out_dtype >= 0 && std::strcmp(d.op, "all_reduce") != 0 && std::strcmp(d.op, "broadcast") != 0)
    s += " -> " + side(d.out_dtype, d.out_numel);
  return s + ")";
}

// Reductions run in f32 for the 16-bit floats (MPI has no type for them), in place otherwise.
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

Tensor widened(const Tensor& t) {
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
  if (op != ReduceKind::average) return;
  const Tensor factor = full({}, 1.0 / size, TensorOptions(t.dtype()));
  backend(kCPU).binary(BinaryOp::mul, t, factor.expand(t.shape()), t);
}

MPI_Op mpi_op(ReduceKind op) { return op == ReduceKind::max ? MPI_MAX : MPI_SUM; }

}  // namespace

MpiGroup::MpiGroup() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
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

void MpiGroup::agree(const char* op, const Tensor* input, const Tensor* output, ReduceKind reduce, int root) {
  Descriptor mine{};
  std::strncpy(mine.op, op, sizeof mine.op - 1);
  mine.reduce = static_cast<int32_t>(reduce);
  mine.root = root;
  mine.in_dtype = input ? static_cast<int32_t>(input->dtype()) : -1;
  mine.out_dtype = output ? static_cast<int32_t>(output->dtype()) : -1;
  mine.in_numel = input ? input->numel() : 0;
  mine.out_numel = output ? output->numel() : 0;
  std::vector<Descriptor> all(size_);
  check(MPI_Allgather(&mine, sizeof mine, MPI_BYTE, all.data(), sizeof mine, MPI_BYTE, MPI_COMM_WORLD),
        "MPI_Allgather (call check)");
  const int64_t index = calls_++;
  for (int q = 1; q < size_; ++q)
    if (std::memcmp(&all[0], &all[q], sizeof mine) != 0)
      fail("mpi group: collective #", index, " does not match across ranks: rank 0 called ", describe(all[0]),
           ", rank ", q, " called ", describe(all[q]));
}

void MpiGroup::all_reduce(const Tensor& buffer, ReduceKind op) {
  check_cpu("all_reduce", buffer);
  agree("all_reduce", &buffer, &buffer, op, 0);
  const Tensor work = is_16bit(buffer.dtype()) ? widened(buffer) : buffer;
  check(MPI_Allreduce(MPI_IN_PLACE, work.data_ptr(), static_cast<int>(work.numel()), mpi_type(work.dtype()),
                      mpi_op(op), MPI_COMM_WORLD),
        "MPI_Allreduce");
  scale(work, op, size_);
  if (!work.is_same(buffer)) backend(kCPU).copy(work, buffer);
  count_ring(2.0 * (size_ - 1) / size_, buffer.nbytes());
}

void MpiGroup::reduce_scatter(const Tensor& input, const Tensor& output, ReduceKind op) {
  check_cpu("reduce_scatter", input);
  check_cpu("reduce_scatter", output);
  ZG_CHECK(input.numel() == output.numel() * size_ && input.dtype() == output.dtype(), "reduce_scatter: input ",
           zg::describe(input), " must be world size (", size_, ") times output ", zg::describe(output));
  agree("reduce_scatter", &input, &output, op, 0);
  const Tensor send = is_16bit(input.dtype()) ? widened(input) : input;
  Tensor result;
  {
    MemoryScope scope(MemoryCategory::communication);
    result = empty(output.shape(), TensorOptions(send.dtype()));
  }
  check(MPI_Reduce_scatter_block(send.data_ptr(), result.data_ptr(), static_cast<int>(output.numel()),
                                 mpi_type(send.dtype()), mpi_op(op), MPI_COMM_WORLD),
        "MPI_Reduce_scatter_block");
  scale(result, op, size_);
  backend(kCPU).copy(result, output);
  count_ring(static_cast<double>(size_ - 1) / size_, input.nbytes());
}

void MpiGroup::all_gather(const Tensor& input, const Tensor& output) {
  check_cpu("all_gather", input);
  check_cpu("all_gather", output);
  ZG_CHECK(output.numel() == input.numel() * size_ && input.dtype() == output.dtype(), "all_gather: output ",
           zg::describe(output), " must be world size (", size_, ") times input ", zg::describe(input));
  agree("all_gather", &input, &output, ReduceKind::sum, 0);
  const int bytes = static_cast<int>(input.nbytes());
  const bool in_place = input.storage() == output.storage() && input.offset() == output.offset() + rank_ * input.numel();
  check(MPI_Allgather(in_place ? MPI_IN_PLACE : input.data_ptr(), in_place ? 0 : bytes, MPI_BYTE, output.data_ptr(),
                      bytes, MPI_BYTE, MPI_COMM_WORLD),
        "MPI_Allgather");
  count_ring(static_cast<double>(size_ - 1) / size_, output.nbytes());
}

void MpiGroup::broadcast(const Tensor& buffer, int root) {
  check_cpu("broadcast", buffer);
  ZG_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is not a rank of a group of ", size_);
  agree("broadcast", &buffer, &buffer, ReduceKind::sum, root);
  check(MPI_Bcast(buffer.data_ptr(), static_cast<int>(buffer.nbytes()), MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast");
  count_ring(static_cast<double>(size_ - 1) / size_, buffer.nbytes());
}

void MpiGroup::barrier() {
  agree("barrier", nullptr, nullptr, ReduceKind::sum, 0);
  check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
}

}  // namespace zg::dist
