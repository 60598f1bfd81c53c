// The `mpi` process group: one rank per process, launched with mpirun, for CPU
// tensors (and, later, the bootstrap of NCCL across processes and nodes).
//
// MPI cannot tell that two ranks called different collectives -- it hangs or
// mixes up buffers. So before every collective the ranks all-gather a small
// descriptor of what each one is calling, and a mismatch fails every rank with a
// message naming both calls. A rank that fails exits non-zero, and mpirun ends
// the others.
#pragma once

#include "dist/process_group.h"

namespace zg::dist {

class MpiGroup final : public HostGroup {
 public:
  // Initialises MPI on first use (MPI_COMM_WORLD). Call MpiGroup::finalize() before exit.
  MpiGroup();
  static void finalize();
  static bool launched_by_mpirun();  // true when the environment says this process is an MPI rank

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string kind() const override { return "mpi"; }
  bool accepts(Device device) const override { return device == kCPU; }
  ~MpiGroup() override { stop_worker(); }

 private:
  void run(const Collective& collective) override;
  void agree(const Collective& collective);
  int rank_ = 0, size_ = 1;
  int64_t calls_ = 0;
};

}  // namespace zg::dist
