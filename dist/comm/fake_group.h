// The `fake` process group: this process is rank r of N, alone. Collectives are
// validated and counted as a real ring would send them (ProcessGroup does both),
// but move nothing -- with the meta device this plans memory and traffic for any N.
// Tensors with data get what this rank would if every rank held the same buffers,
// where that is knowable alone (all_reduce, broadcast; everything at N = 1); a
// reduce_scatter or all_gather of them at N > 1 is refused (fake_group.cpp).
// Each one is complete when issued (no worker thread), so a dry run's peaks do not
// depend on when a thread lets go of a buffer: the same run gives the same figures.
// Under a StepLogScope each collective and each wait for it is logged (tensor/step_log.h),
// with the group's place in the mesh, for a step-time model to replay.
#pragma once

#include "dist/comm/process_group.h"

namespace zg::dist {

class FakeGroup : public ProcessGroup {
 public:
  // `stride`: how far apart its ranks are in the whole job (a device mesh's dimension: its stride).
  FakeGroup(int rank, int size, int stride = 1);
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string kind() const override { return "fake"; }
  bool accepts(Device) const override { return true; }
  // A fake rank cannot learn the others' colours: split refuses at N > 1 (at N = 1 the
  // new group is this rank alone). A grid needs no colours: rank (r / stride) % size of
  // `size`, its ranks stride x this group's stride apart in the job.
  std::unique_ptr<ProcessGroup> split(int color, int key) override;
  int stride() const { return stride_; }

 private:
  WorkHandle issue(Collective collective) override;
  // Messages are counted and logged; a received buffer with data at N > 1 is refused
  // (the sender's bytes do not exist here), as a reduce_scatter's.
  std::vector<WorkHandle> issue_p2p(std::vector<Collective> messages) override;
  std::unique_ptr<ProcessGroup> subgroup(const std::vector<int>& members, int color, int key) override;
  std::unique_ptr<ProcessGroup> make_grid(int size, int stride) override;
  int rank_, size_, stride_;
};

// The trivial group of one: training on one device is a ShardedModel over this group,
// the same code as N ranks (one training path, docs/design.md), every collective the identity.
class SingleRank final : public FakeGroup {
 public:
  SingleRank() : FakeGroup(0, 1) {}
  std::string kind() const override { return "single"; }
};

}  // namespace zg::dist
