// Process groups: the collectives every strategy is built from, behind one
// interface. Implementations: `local` (ranks as threads of one process, data moved
// through shared memory; tests and single-machine runs), `fake` (one rank that
// believes it is one of N: moves nothing, counts everything; for memory planning
// at large N on the meta device), `mpi` (one process per rank, under mpirun; CPU
// tensors) and `nccl` (one GPU per rank, dist/nccl_group.h).
//
// Every collective is asynchronous underneath. `x_async(...)` validates the call,
// counts its bytes and issues it; the returned Work's wait() makes the caller's
// later work see the result and rethrows the collective's error. The blocking forms
// are `x_async(...)->wait()`. Until wait() returns, the caller must not touch the
// buffers. How a group issues:
//   HostGroup (local, mpi)  a communication worker thread runs the group's
//       collectives one at a time, in issue order (the ranks issue the same sequence,
//       so they meet in the same order); wait() blocks until the result is there.
//       The queued collective keeps its buffers alive, so a buffer the caller drops
//       early is freed once the collective has run (how ZeRO-2 frees a unit gradient).
//   NcclGroup  NCCL kernels on the rank's communication stream; wait() makes the
//       rank's compute stream wait for them, without blocking the host.
//   FakeGroup  nothing moves: every collective is complete when issued.
//
// Every collective is counted the way a ring implementation moves data, per rank:
//   all_reduce      2 (N-1)/N x bytes of the buffer
//   reduce_scatter    (N-1)/N x bytes of the full (input) buffer
//   all_gather        (N-1)/N x bytes of the full (output) buffer
//   broadcast         (N-1)/N x bytes (a pipelined ring)
//   send              the bytes of the message (a receive sends nothing)
//
// Point to point (send, recv, batch): one rank's message to another -- a pipeline
// stage's activations, and their gradients coming back. These bypass the ordered queue
// of collectives: a message is posted at once and completes when its partner is posted
// on the other rank, so two ranks that send to each other at the same time (1F1B's
// steady state) do not wait on each other. Between one pair of ranks, sends and receives
// pair in the order posted -- rank a's k-th send to b with b's k-th receive from a --
// and the pair is compared like a collective (dtype, numel, device type, tag): a
// mismatch fails both ends, each naming both calls, before any data moves.
#pragma once

#include <array>
#include <cstdint>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace zg::dist {

enum class ReduceKind : uint8_t { sum, average, max };
enum class CollectiveOp : uint8_t { all_reduce, reduce_scatter, all_gather, broadcast, barrier, send, recv };
const char* name(ReduceKind op);
const char* name(CollectiveOp op);

// One collective call, as every rank must agree on it.
struct Collective {
  CollectiveOp op = CollectiveOp::barrier;
  Tensor input, output;  // all_reduce, broadcast, send, recv: the same buffer; barrier: none
  ReduceKind reduce = ReduceKind::sum;
  int root = 0;     // broadcast: the root; send, recv: the peer
  int64_t tag = 0;  // the issuing thread's CollectiveTag
  std::string describe() const;  // "reduce_scatter(bf16[1024] on cpu -> bf16[256] on cpu, average)"
  // The bytes one rank sends for it in a ring of `world_size` ranks (table above).
  int64_t ring_bytes(int world_size) const;

  // What ranks compare to detect a mismatch, as numbers (op, reduce, root, dtype and
  // numel of input and output -- -1 for an absent buffer --, the device type and the
  // tag), so groups can exchange calls between processes and print any rank's call.
  using Signature = std::array<int64_t, 9>;
  Signature signature() const;
  static std::string describe(const Signature& signature);
  // "" if every rank's signature equals rank 0's; else "<group>: collective #<index>
  // does not match across ranks: rank 0 called ..., rank q called ...".
  static std::string mismatch(const std::vector<Signature>& all, int64_t index, const std::string& group);
  // "" if rank `src`'s send and rank `dst`'s receive agree (dtype, numel, device type,
  // tag); else "<group>: message #<index> from rank <src> to rank <dst> does not match:
  // rank <src> sent ..., rank <dst> receives ...".
  static std::string p2p_mismatch(const Signature& send, const Signature& recv, int src, int dst, int64_t index,
                                  const std::string& group);
};

// One message of a batch (ProcessGroup::batch_async), as torch.distributed's P2POp.
struct P2POp {
  enum Kind : uint8_t { send, recv } kind = send;
  Tensor buffer;  // send: what goes; recv: where it lands
  int peer = 0;
  int64_t tag = 0;
};

// Collectives issued on this thread within a CollectiveTag's scope carry its tag, which
// ranks compare with the rest of the call. Two calls alike in op, dtype and size but
// for different things -- ShardedModel tags each unit's gathers and reductions with the
// unit's number -- then no longer pair silently when ranks issue them in another order:
// the mismatch error names both.
class CollectiveTag {
 public:
  explicit CollectiveTag(int64_t tag);
  ~CollectiveTag();
  CollectiveTag(const CollectiveTag&) = delete;
  CollectiveTag& operator=(const CollectiveTag&) = delete;
  static int64_t current();  // 0 outside any scope

 private:
  int64_t previous_;
};

// A group's collective timeout as it waits on it: positive (else zg::Error naming
// `group`), and at most a century, so that now + timeout stays within the clock's range
// (milliseconds::max(), meant as "never", timed out at once).
std::chrono::milliseconds checked_timeout(const char* group, std::chrono::milliseconds timeout);

// A collective in flight.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;              // returns once done; rethrows the collective's error
  virtual bool completed() const = 0;   // never blocks; true once it ended, with or without an error
};
using WorkHandle = std::shared_ptr<Work>;

class ProcessGroup {
 public:
  ProcessGroup() = default;
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string kind() const = 0;  // "local", "fake", "mpi", "nccl"
  // Whether its collectives take tensors on `device` (mpi: the CPU only; nccl: its GPU only).
  virtual bool accepts(Device device) const = 0;

  // Sub-groups, as MPI_Comm_split: the ranks that pass one `color` form a group of their
  // own, ranked by (key, rank). A collective: every rank calls it and gets its new group,
  // which must not outlive this one. Its collectives are its own, apart from this group's.
  virtual std::unique_ptr<ProcessGroup> split(int color, int key);
  // A regular sub-grid (a device mesh's dimension, dist/comm/device_mesh.h): the `size`
  // ranks `stride` apart that hold this rank, r + (j - c) stride with c = (r / stride) % size,
  // ranked by j. A collective (a split), unless a group knows its place without the others.
  std::unique_ptr<ProcessGroup> split_grid(int size, int stride);

  // The buffer a collective writes is an in-place write (begin_inplace, tensor/tensor.h):
  // refused if it requires grad while grad mode is on, and its version is bumped, so a
  // tensor saved for backward that a collective overwrites fails loudly in backward.
  //
  // In place on every rank; buffers must match in dtype and numel across ranks.
  WorkHandle all_reduce_async(const Tensor& buffer, ReduceKind op = ReduceKind::sum);
  // input [N * S] on every rank -> output [S]: the reduction of every rank's slice `rank`.
  // output may be input's own slice (in place).
  WorkHandle reduce_scatter_async(const Tensor& input, const Tensor& output, ReduceKind op = ReduceKind::sum);
  // input [S] on every rank -> output [N * S], rank q's input in slice q. input may be output's own slice.
  WorkHandle all_gather_async(const Tensor& input, const Tensor& output);
  WorkHandle broadcast_async(const Tensor& buffer, int root);

  void all_reduce(const Tensor& buffer, ReduceKind op = ReduceKind::sum) { all_reduce_async(buffer, op)->wait(); }
  void reduce_scatter(const Tensor& input, const Tensor& output, ReduceKind op = ReduceKind::sum) {
    reduce_scatter_async(input, output, op)->wait();
  }
  void all_gather(const Tensor& input, const Tensor& output) { all_gather_async(input, output)->wait(); }
  void broadcast(const Tensor& buffer, int root) { broadcast_async(buffer, root)->wait(); }
  void barrier();  // returns when every rank has reached it (the host waits, on every group)

  // Point to point (see the top of this file). `tensor` goes to rank `dst`; `buffer`, of
  // the same dtype and numel on this rank, receives what rank `src` sends. A rank does not
  // message itself. The Work completes once the partner is posted and the bytes moved;
  // until then the buffer must not be touched. A mismatched pair fails both Works.
  WorkHandle send_async(const Tensor& tensor, int dst, int64_t tag = 0);
  WorkHandle recv_async(const Tensor& buffer, int src, int64_t tag = 0);
  // Several messages posted together (torch's batch_isend_irecv); one Work for all.
  // The nccl group needs crossing messages in one batch (one NCCL group call).
  WorkHandle batch_async(const std::vector<P2POp>& ops);
  // All-to-all (MPI_Alltoall) of each input, [n c] contiguous 1-D: its chunk j goes to rank
  // j, whose chunk from rank i lands in chunk i of the matching output. Messages in one
  // batch (what NCCL's all-to-all is), this rank's own chunk copied locally; tag t for input t.
  WorkHandle all_to_all_async(const std::vector<Tensor>& inputs, const std::vector<Tensor>& outputs);
  void send(const Tensor& tensor, int dst, int64_t tag = 0) { send_async(tensor, dst, tag)->wait(); }
  void recv(const Tensor& buffer, int src, int64_t tag = 0) { recv_async(buffer, src, tag)->wait(); }

  // Bytes this rank has sent (ring model above), since construction or reset.
  int64_t bytes_sent() const { return bytes_sent_; }
  void reset_bytes_sent() { bytes_sent_ = 0; }

  // Expires when this group is destroyed: what keeps the group past a call holds a
  // GroupRef (below), which checks it before each use.
  std::weak_ptr<const ProcessGroup> lifetime() const { return alive_; }

 protected:
  // Issues one validated collective (see the top of this file).
  virtual WorkHandle issue(Collective collective) = 0;
  // Posts validated messages (ops send and recv, the peer in `root`), outside the
  // collective queue; a Work each. Groups without point-to-point messages refuse.
  virtual std::vector<WorkHandle> issue_p2p(std::vector<Collective> messages);
  // split()'s new group, once every rank's colour is known: `members` are the ranks of
  // this group that form it, in their new order. Groups that can split override it.
  virtual std::unique_ptr<ProcessGroup> subgroup(const std::vector<int>& members, int color, int key);
  // split_grid's group, its size and stride checked: a split by colour r - c stride.
  virtual std::unique_ptr<ProcessGroup> make_grid(int size, int stride);

 private:
  WorkHandle submit(Collective collective);
  Collective message(const P2POp& op) const;  // validated: a send or recv to post
  int64_t bytes_sent_ = 0;
  // Points at this group but shares the lifetime of a control block only this member
  // holds: the holders' weak references expire exactly when the group goes.
  std::shared_ptr<const ProcessGroup> alive_{std::make_shared<char>(), this};
};

// A group kept past a call -- a DeviceMesh's world, a ShardedModel's groups. Using it once
// the group is destroyed is a zg::Error (`destroyed`: whose group it was and what to do),
// not undefined behaviour, as PyTorch refuses a group that destroy_process_group ended.
// The groups run_local and run_mpi hand out outlive what is built on them; one made by
// hand (a split, a FakeGroup, an NcclGroup) must be kept as long as its users, or they throw.
class GroupRef {
 public:
  GroupRef(ProcessGroup& group, const char* destroyed)
      : group_(&group), alive_(group.lifetime()), destroyed_(destroyed) {}
  ProcessGroup& operator*() const {
    ZG_CHECK(!alive_.expired(), destroyed_);
    return *group_;
  }
  ProcessGroup* operator->() const { return &**this; }

 private:
  ProcessGroup* group_;
  std::weak_ptr<const ProcessGroup> alive_;
  const char* destroyed_;
};

// buffer *= factor through the backend, as collectives write their outputs: no version
// bump (the caller's begin_inplace made the one). An average's 1/N, a fake sum's N.
void scale_buffer(const Tensor& buffer, double factor);

class CommWorker;

// A group whose collectives run on the host: one communication worker thread per
// group runs them in issue order.
class HostGroup : public ProcessGroup {
 public:
  HostGroup();
  ~HostGroup() override;

 protected:
  // Runs one collective to completion. Called on the communication worker thread,
  // with the issuing rank's Context and memory category current.
  virtual void run(const Collective& collective) = 0;
  // A concrete group calls this first thing in its destructor: it finishes the
  // queued collectives while the group is still whole (they call run()).
  void stop_worker();

 private:
  WorkHandle issue(Collective collective) final;
  std::unique_ptr<CommWorker> worker_;
};

}  // namespace zg::dist
