// A device mesh: the world's N ranks laid out as a grid of named dimensions, each a
// process group -- PyTorch's DeviceMesh. Ranks are numbered row-major, the last
// dimension fastest (torch.arange(N).view(sizes)): along dimension d of size n_d,
//
//   stride_d = n_{d+1} x ... x n_{k-1}        coordinate c_d(r) = (r / stride_d) % n_d
//   group_d(r) = { r + (j - c_d(r)) stride_d : j = 0 .. n_d - 1 }, rank j in it
//
// So the innermost dimensions are the ranks nearest each other: put the one that talks
// most (tp, then dp_shard) last, where it stays within a node. Typical names, outermost
// first: pp x dp_replicate x dp_shard x cp x tp, any subset. ZeRO shards over dp_shard and
// replicates over dp_replicate (hybrid sharding, HSDP / MiCS); tensor and pipeline
// parallelism take tp and pp.
//
// Every dimension's group is made once, at construction, by ProcessGroup::split_grid (a
// collective on the world, for every group kind); the fake group knows its place in any
// mesh without the others, so a dry run can be rank r of any layout. Each dimension also
// knows its link -- whether its groups lie within one node -- for the step-time model.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dist/comm/process_group.h"

namespace zg::dist {

struct MeshDim {
  std::string name;
  int size = 1;
};

enum class Link : uint8_t { within_node, across_nodes };
const char* name(Link link);

class DeviceMesh {
 public:
  // A collective on `world`: every rank passes the same dimensions, whose sizes multiply
  // to world.size(). `ranks_per_node`: consecutive ranks sharing a node (0: all of them).
  // `world` must outlive the mesh: a mesh used after it was destroyed throws zg::Error.
  DeviceMesh(ProcessGroup& world, std::vector<MeshDim> dims, int ranks_per_node = 0);
  ~DeviceMesh();
  DeviceMesh(const DeviceMesh&) = delete;
  DeviceMesh& operator=(const DeviceMesh&) = delete;

  ProcessGroup& world() const { return *world_; }
  const std::vector<MeshDim>& dims() const { return dims_; }
  bool has(std::string_view dim) const;
  int size(std::string_view dim) const;        // n_d; 1 for a dimension the mesh does not have
  int coordinate(std::string_view dim) const;  // c_d(rank); 0 for one it does not have
  int stride(std::string_view dim) const;      // stride_d
  // This rank's group along `dim` (group.rank() == coordinate(dim)). A zg::Error names the
  // dimensions there are if the mesh has no `dim`.
  ProcessGroup& group(std::string_view dim) const;
  // Adjacent dimensions as one (PyTorch's _flatten): e.g. {"dp_replicate", "dp_shard"} is
  // the whole data-parallel group. A collective, made once per name and then returned.
  ProcessGroup& flatten(const std::string& name, const std::vector<std::string>& dims);
  // The world ranks of this rank's group along `dim`, in group-rank order (the formula above).
  std::vector<int> members(std::string_view dim) const;
  Link link(std::string_view dim) const;  // within a node when every member shares this rank's
  int ranks_per_node() const { return ranks_per_node_; }
  std::string describe() const;           // "pp 2 x dp_shard 2 x tp 2 (8 ranks, 8 a node)"

  // The formula alone, for any rank: group_d(rank) in group-rank order.
  static std::vector<int> members_of(const std::vector<MeshDim>& dims, int rank, size_t dim);

 private:
  size_t index(std::string_view dim) const;  // throws, naming the dimensions there are
  int stride_at(size_t d) const;

  GroupRef world_;
  std::vector<MeshDim> dims_;
  int ranks_per_node_;
  std::vector<std::unique_ptr<ProcessGroup>> owned_;  // a dimension as large as the world uses the world
  std::vector<GroupRef> groups_;                      // one per dimension
  std::vector<std::pair<std::string, GroupRef>> flattened_;
};

// The sizes of a training job's mesh (torchtitan's ParallelDims).
struct ParallelDims {
  int pp = 1;                // pipeline stages' ranks
  int tp = 1;                // tensor-parallel ranks a layer
  int cp = 1;                // context-parallel ranks a sequence (dist/tensor/context_parallel.h)
  int shard_group_size = 0;  // S: ZeRO shards within groups of S data-parallel ranks; 0: all of them
  int ranks_per_node = 0;    // consecutive ranks sharing a node (0: all of them)
};

// The mesh of a training job: [pp P x] dp_replicate R x dp_shard S [x cp C] [x tp T] over
// N = world.size() ranks (pp when P > 1, cp when C > 1, tp when T > 1), tp innermost so that
// a tensor-parallel group's ranks are consecutive (within a node), pp outermost so that a
// stage's ranks are; cp beside dp_shard, so ZeRO shards over dp_shard x cp (torchtitan's
// dp_shard_cp). S = 0: every data-parallel rank, N / (P C T); R = N / (P S C T). A zg::Error
// names a size that does not divide.
std::unique_ptr<DeviceMesh> training_mesh(ProcessGroup& world, const ParallelDims& dims);
std::unique_ptr<DeviceMesh> training_mesh(ProcessGroup& world, int tp = 1, int shard_group_size = 0,
                                          int ranks_per_node = 0);

}  // namespace zg::dist
