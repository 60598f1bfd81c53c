#include "dist/comm/fake_group.h"

#include "tensor/backend.h"
#include "tensor/step_log.h"

namespace zg::dist {

FakeGroup::FakeGroup(int rank, int size, int stride) : rank_(rank), size_(size), stride_(stride) {
  ZG_CHECK(size >= 1 && rank >= 0 && rank < size && stride >= 1, "fake group: rank ", rank, " of ", size,
           " (stride ", stride, ") is not valid");
}

std::unique_ptr<ProcessGroup> FakeGroup::split(int color, int key) {
  ZG_CHECK(size_ == 1, "fake group: rank ", rank_, " of ", size_, " cannot split by colour: the other ranks' colours "
           "do not exist here; a DeviceMesh forms its groups without them");
  return ProcessGroup::split(color, key);
}

std::unique_ptr<ProcessGroup> FakeGroup::subgroup(const std::vector<int>&, int, int) {
  return std::make_unique<FakeGroup>(0, 1);
}

std::unique_ptr<ProcessGroup> FakeGroup::make_grid(int size, int stride) {
  return std::make_unique<FakeGroup>(rank_ / stride % size, size, stride_ * stride);
}

namespace {
// Complete when issued; a wait for it is logged under a StepLogScope (`logged` >= 0).
class Done final : public Work {
 public:
  explicit Done(int64_t logged = -1) : logged_(logged) {}
  void wait() override {
    if (StepLog* log = StepLog::current(); log && logged_ >= 0) log->wait(logged_);
  }
  bool completed() const override { return true; }

 private:
  int64_t logged_;
};
}  // namespace

// Tensors with data get what this rank would get if every rank held the same buffers
// -- where that is knowable without the others:
//   all_reduce   sum: N x; average, max: x          broadcast: x (the root holds the same)
//   N = 1        every collective is the identity (a copy where the output is another buffer)
// A reduce_scatter or all_gather at N > 1 needs the other ranks' shards, which do not
// exist here: refused, where it used to leave the output as it was (uninitialised
// gathered weights, a grad norm of inf). Meta tensors hold nothing to compute.
WorkHandle FakeGroup::issue(Collective c) {
  const Tensor& out = c.output;
  StepLog* log = StepLog::current();
  const int64_t logged =
      log ? log->issue(static_cast<int>(c.op), static_cast<double>(c.ring_bytes(size_)), this, size_, stride_) : -1;
  if (!out.defined() || out.device().type == DeviceType::meta) return std::make_shared<Done>(logged);
  switch (c.op) {
    case CollectiveOp::all_reduce:
      if (c.reduce == ReduceKind::sum && size_ > 1) scale_buffer(out, size_);
      break;
    case CollectiveOp::reduce_scatter:
    case CollectiveOp::all_gather:
      ZG_CHECK(size_ == 1, "fake group: rank ", rank_, " of ", size_, " cannot compute ", c.describe(),
               " on tensors with data: the other ranks' shards do not exist here; use meta tensors (a dry run) or "
               "run_local");
      if (c.input.storage() != out.storage() || c.input.offset() != out.offset()) backend(out.device()).copy(c.input, out);
      break;
    case CollectiveOp::recv:
      ZG_CHECK(false, "fake group: rank ", rank_, " of ", size_, " cannot receive ", c.describe(),
               " into a tensor with data: the sender's bytes do not exist here; use meta tensors (a dry run) or "
               "run_local");
      break;
    case CollectiveOp::broadcast:
    case CollectiveOp::barrier:
    case CollectiveOp::send: break;
  }
  return std::make_shared<Done>(logged);
}

std::vector<WorkHandle> FakeGroup::issue_p2p(std::vector<Collective> messages) {
  std::vector<WorkHandle> works;
  for (Collective& m : messages) works.push_back(issue(std::move(m)));
  return works;
}

}  // namespace zg::dist
