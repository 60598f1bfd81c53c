// The `fake` process group: this process is rank r of N, alone. Collectives are
// validated and counted as a real ring would send them (ProcessGroup does both),
// but move nothing -- with the meta device this plans memory and traffic for any N.
#pragma once

#include "dist/process_group.h"

namespace zg::dist {

class FakeGroup final : public HostGroup {
 public:
  FakeGroup(int rank, int size);
  ~FakeGroup() override { stop_worker(); }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string kind() const override { return "fake"; }

 private:
  void run(const Collective&) override {}
  int rank_, size_;
};

}  // namespace zg::dist
