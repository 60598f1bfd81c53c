// The `mpi` process group: one rank per process, launched with mpirun, for CPU
// tensors, and the host group that bootstraps NCCL across processes and nodes
// (NcclGroup::bootstrap).
//
// MPI cannot tell that two ranks called different collectives -- it hangs or
// mixes up buffers. So before every collective each rank sends every other a small
// descriptor of what it is calling, and a mismatch fails every rank with a message
// naming both calls.
//
// Nor does MPI time out: a rank that never arrives (stuck, or it caught an error and
// went on) leaves the others in the collective for ever. So every call is MPI's
// non-blocking form, polled until done or until `timeout` has passed; then the call
// fails with a zg::Error -- naming the ranks whose descriptor never came -- and the group
// is unusable (MPI cannot cancel a collective: the process should exit, and mpirun ends
// the job when a rank exits non-zero).
//
// A rank that fails says so: fail_others (which run_mpi calls for an exception) sends its
// message to every other rank on a communicator of its own, and each throws
// "mpi group: rank q failed: <message>" from the collective it waits in -- at once, not
// at the timeout -- or from its next one.
//
// Point-to-point messages (ProcessGroup::send_async ...) are posted from the calling
// thread, not the group's worker: both ends exchange their calls first, so a mismatched
// pair fails both, naming both calls, and only a matching pair moves its bytes
// (dist/comm/mpi_process.h). A message waited for longer than the timeout leaves the
// group unusable, as a collective does.
//
// split() makes groups over sub-communicators (MPI_Comm_split). They share the process's
// MPI lock (MPI_THREAD_SERIALIZED: each group's worker takes turns with the others) and
// its failure state: a notice from any rank reaches a rank waiting in any group, and a
// group that times out leaves every group of the process unusable.
#pragma once

#include <chrono>
#include <functional>
#include <memory>

#include "dist/comm/process_group.h"

namespace zg::dist {

struct MpiProcess;  // what the MpiGroups of one process share (mpi_group.cpp)

struct MpiOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

class MpiGroup final : public HostGroup {
 public:
  // Initialises MPI on first use (MPI_COMM_WORLD). Call MpiGroup::finalize() before exit
  // (not after a timeout: the abandoned collective would keep MPI_Finalize waiting).
  explicit MpiGroup(MpiOptions options = {});
  static void finalize();

  // Tells every other rank this one failed, with `message` (see above), and leaves the
  // group unusable here too. Waits up to 5 s for the others to acknowledge, so they can
  // report it before mpirun ends the job.
  void fail_others(const std::string& message);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string kind() const override { return "mpi"; }
  bool accepts(Device device) const override { return device == kCPU; }
  ~MpiGroup() override;

 private:
  MpiGroup(std::shared_ptr<MpiProcess> process, int comm, std::chrono::milliseconds timeout);  // split's
  std::unique_ptr<ProcessGroup> subgroup(const std::vector<int>& members, int color, int key) override;
  void run(const Collective& collective) override;
  std::vector<WorkHandle> issue_p2p(std::vector<Collective> messages) override;
  void agree(const Collective& collective);
  // After a call (`what`, for `collective`) has not finished within the timeout: marks the
  // group broken and throws, saying which ranks it waited for (`stuck`). `keep` holds the
  // buffers MPI may still write; kept for ever.
  [[noreturn]] void time_out(const char* what, const Collective& collective, const std::string& stuck,
                             std::shared_ptr<void> keep);
  // Polls `count` MPI_Requests at `requests` until all complete (true), the timeout passes
  // (false), or another rank's failure notice arrives or this rank failed (throws).
  bool completes(void* requests, int count, const Collective& collective, const std::shared_ptr<void>& keep);
  // completes' loop: polls `done` (called under the MPI lock) for `what` until true, the
  // timeout (false), or a failure notice or broken group (throws).
  bool polls(const std::function<bool()>& done, const std::string& what, const std::shared_ptr<void>& keep);
  [[noreturn]] void give_up(std::string why, std::shared_ptr<void> keep);
  std::shared_ptr<MpiProcess> process_;
  int comm_ = 0;  // this group's communicator (a Fortran handle: no mpi.h here)
  int rank_ = 0, size_ = 1;
  int64_t calls_ = 0;
  std::vector<int64_t> messages_to_, messages_from_;  // per peer: sends and receives posted so far
  std::chrono::milliseconds timeout_;
  class MessageWork;
};

// Runs fn(group) on this process's rank of a new MpiGroup, as a launcher runs a worker,
// and returns the process's exit status: 0 once every rank has finished (MPI is then
// finalized); 1 after an exception, printed to stderr as "rank r: <what>" and then sent
// to every other rank (fail_others), so that each of them ends promptly with it too.
int run_mpi(const std::function<void(ProcessGroup&)>& fn, MpiOptions options = {});

}  // namespace zg::dist
