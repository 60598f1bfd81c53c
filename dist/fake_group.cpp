#include "dist/fake_group.h"

namespace zg::dist {

FakeGroup::FakeGroup(int rank, int size) : rank_(rank), size_(size) {
  ZG_CHECK(size >= 1 && rank >= 0 && rank < size, "fake group: rank ", rank, " of ", size, " is not valid");
}

void FakeGroup::all_reduce(const Tensor& buffer, ReduceKind) {
  count_ring(2.0 * (size_ - 1) / size_, buffer.nbytes());
}

void FakeGroup::reduce_scatter(const Tensor& input, const Tensor& output, ReduceKind) {
  ZG_CHECK(input.numel() == output.numel() * size_ && input.dtype() == output.dtype(), "reduce_scatter: input ",
           describe(input), " must be world size (", size_, ") times output ", describe(output));
  count_ring(static_cast<double>(size_ - 1) / size_, input.nbytes());
}

void FakeGroup::all_gather(const Tensor& input, const Tensor& output) {
  ZG_CHECK(output.numel() == input.numel() * size_ && input.dtype() == output.dtype(), "all_gather: output ",
           describe(output), " must be world size (", size_, ") times input ", describe(input));
  count_ring(static_cast<double>(size_ - 1) / size_, output.nbytes());
}

void FakeGroup::broadcast(const Tensor& buffer, int root) {
  ZG_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is not a rank of a group of ", size_);
  count_ring(static_cast<double>(size_ - 1) / size_, buffer.nbytes());
}

}  // namespace zg::dist
