// The `nccl` process group: CUDA tensors, one GPU per rank, collectives as NCCL
// kernels on the rank's communication stream.
//
// Issue order and overlap: when a collective is issued, an event recorded on the
// rank's compute stream marks where its inputs are complete; the communication
// stream waits for that event (on the device), runs the NCCL kernel and records a
// `done` event. Work::wait() makes the compute stream wait for `done` -- the host
// never blocks -- so a reduction overlaps the backward that continues after it.
// The buffers are marked as used on the communication stream (record_stream), so
// the caching allocator reuses them only after the collective has finished.
//
// No hangs: NCCL cannot tell that ranks called different collectives. With a host
// group (the one that bootstrapped it, e.g. MpiGroup) and `check_calls` on, every
// call's signature is compared across ranks first (a small host all-gather), and a
// mismatch fails every rank naming both calls. The communicator is non-blocking: no
// NCCL call -- creating the communicator, a first collective that connects to its
// peers, finalizing it -- waits more than `timeout` for the other ranks. A watchdog
// thread aborts the communicator when a collective has not finished on the device
// within `timeout` (a rank died or diverged), so the others fail with an error
// instead of waiting forever.
//
// Point to point: ncclSend / ncclRecv, a batch in one NCCL group call -- messages that
// cross between two ranks must be in one batch, or the two sends wait for each other on
// the device. With the host group and `check_calls`, the two ends first exchange their
// calls over the host (the sender's on the host group, the receiver's answer on a
// duplicate of it, so each direction carries one kind); the host waits for the peer, and
// a mismatch fails both ends, naming both calls, before NCCL moves anything.
#pragma once

#include <array>
#include <chrono>
#include <memory>

#include "dist/comm/process_group.h"
#include "tensor/device.h"

namespace zg::dist {

using NcclId = std::array<char, 128>;  // ncclUniqueId's bytes

struct NcclOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  bool check_calls = true;  // compare every call across ranks through the host group
};

class NcclGroup final : public ProcessGroup {
 public:
  // A fresh communicator id, made by one rank and given to all (see bootstrap).
  static NcclId unique_id();
  // Joins the communicator `id` as rank `rank` of `size`, on `device` (a GPU of its own).
  NcclGroup(const NcclId& id, int rank, int size, Device device, ProcessGroup* host = nullptr,
            NcclOptions options = {});
  // Rank 0 of `host` (e.g. an MpiGroup under mpirun, across processes and nodes) makes
  // the id and broadcasts it; every rank then joins with the host group's rank and size.
  // First the ranks agree, over `host`, that each has a GPU of its own: a missing device
  // or two ranks on one GPU fails every rank, naming them, before NCCL could hang.
  static std::unique_ptr<NcclGroup> bootstrap(ProcessGroup& host, Device device, NcclOptions options = {});
  ~NcclGroup() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string kind() const override { return "nccl"; }
  bool accepts(Device device) const override { return device == device_; }
  Device device() const { return device_; }
  // A new communicator over the host group's split (its rank 0 makes the id): needs the
  // host group this one was bootstrapped over.
  std::unique_ptr<ProcessGroup> split(int color, int key) override;

  struct Communicator;  // the NCCL communicator, its watchdog and pending work (nccl_group.cpp)

 private:
  WorkHandle issue(Collective collective) override;
  std::vector<WorkHandle> issue_p2p(std::vector<Collective> messages) override;
  void agree(const Collective& collective);                 // compares the call across ranks through host_
  void agree_p2p(const std::vector<Collective>& messages);  // compares each message with its peer's, through host_
  // Puts `launch` (the NCCL calls) on the communication stream after the compute stream's
  // work so far; `buffers` are marked used there. The Work waits for it.
  struct Launch;
  WorkHandle enqueue(const Launch& launch);

  std::unique_ptr<ProcessGroup> owned_host_;  // a split's host group (outlives the communicator)
  int rank_, size_;
  Device device_;
  ProcessGroup* host_;
  std::unique_ptr<ProcessGroup> answers_;  // host_'s duplicate for the answers of agree_p2p
  NcclOptions options_;
  int64_t calls_ = 0;
  std::vector<int64_t> sent_, received_;  // per peer: messages checked so far (agree_p2p)
  std::shared_ptr<Communicator> communicator_;
};

}  // namespace zg::dist
