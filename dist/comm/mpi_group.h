// The `mpi` process group: one rank per process, launched with mpirun, for CPU
// tensors, and the host group that bootstraps NCCL across processes and nodes
// (NcclGroup::bootstrap).
//
// MPI cannot tell that two ranks called different collectives -- it hangs or
// mixes up buffers. So before every collective the ranks all-gather a small
// descriptor of what each one is calling, and a mismatch fails every rank with a
// message naming both calls.
//
// Nor does MPI time out: a rank that never arrives (stuck, or it caught an error and
// went on) leaves the others in the collective for ever. So every call is MPI's
// non-blocking form, polled until done or until `timeout` has passed; then the call
// fails with a zg::Error and the group is unusable (MPI cannot cancel a collective:
// the process should exit, and mpirun ends the job when a rank exits non-zero).
#pragma once

#include <chrono>

#include "dist/comm/process_group.h"

namespace zg::dist {

struct MpiOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

class MpiGroup final : public HostGroup {
 public:
  // Initialises MPI on first use (MPI_COMM_WORLD). Call MpiGroup::finalize() before exit
  // (not after a timeout: the abandoned collective would keep MPI_Finalize waiting).
  explicit MpiGroup(MpiOptions options = {});
  static void finalize();

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string kind() const override { return "mpi"; }
  bool accepts(Device device) const override { return device == kCPU; }
  ~MpiGroup() override { stop_worker(); }

 private:
  void run(const Collective& collective) override;
  void agree(const Collective& collective);
  // After a call (`what`, for `collective`) has not finished within the timeout: marks the
  // group broken and throws. `keep` holds the buffers MPI may still write; kept for ever.
  [[noreturn]] void time_out(const char* what, const Collective& collective, std::shared_ptr<void> keep);
  int rank_ = 0, size_ = 1;
  int64_t calls_ = 0;
  std::chrono::milliseconds timeout_;
  std::string broken_;  // why the group is unusable (a collective timed out); "" while it works
};

}  // namespace zg::dist
