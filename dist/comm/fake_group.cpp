#include "dist/comm/fake_group.h"

#include "tensor/backend.h"

namespace zg::dist {

FakeGroup::FakeGroup(int rank, int size) : rank_(rank), size_(size) {
  ZG_CHECK(size >= 1 && rank >= 0 && rank < size, "fake group: rank ", rank, " of ", size, " is not valid");
}

std::unique_ptr<ProcessGroup> FakeGroup::split(int color, int key) {
  ZG_CHECK(size_ == 1, "fake group: rank ", rank_, " of ", size_, " cannot split by colour: the other ranks' colours "
           "do not exist here; split_mesh forms hybrid sharding's groups without them");
  return ProcessGroup::split(color, key);
}

std::unique_ptr<ProcessGroup> FakeGroup::subgroup(const std::vector<int>&, int, int) {
  return std::make_unique<FakeGroup>(0, 1);
}

ProcessGroup::Mesh FakeGroup::make_mesh(int shard_size) {
  Mesh mesh;
  mesh.shard = std::make_unique<FakeGroup>(rank_ % shard_size, shard_size);
  mesh.replicas = std::make_unique<FakeGroup>(rank_ / shard_size, size_ / shard_size);
  return mesh;
}

namespace {
class Done final : public Work {
 public:
  void wait() override {}
  bool completed() const override { return true; }
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
  if (!out.defined() || out.device().type == DeviceType::meta) return std::make_shared<Done>();
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
    case CollectiveOp::broadcast:
    case CollectiveOp::barrier: break;
  }
  return std::make_shared<Done>();
}

}  // namespace zg::dist
