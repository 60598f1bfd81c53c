// The `fake` process group: this process is rank r of N, alone. Collectives
// check their arguments and count the bytes a real ring would send, but move
// nothing -- with the meta device this plans memory and traffic for any N.
#pragma once

#include "dist/process_group.h"

namespace zg::dist {

class FakeGroup final : public ProcessGroup {
 public:
  FakeGroup(int rank, int size);
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string kind() const override { return "fake"; }
  void all_reduce(const Tensor& buffer, ReduceKind op) override;
  void reduce_scatter(const Tensor& input, const Tensor& output, ReduceKind op) override;
  void all_gather(const Tensor& input, const Tensor& output) override;
  void broadcast(const Tensor& buffer, int root) override;
  void barrier() override {}

 private:
  int rank_, size_;
};

}  // namespace zg::dist
