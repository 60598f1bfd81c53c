#include "dist/comm/device_mesh.h"

#include <set>

#include "dist/comm/fake_group.h"

namespace zg::dist {

const char* name(Link link) { return link == Link::within_node ? "within node" : "across nodes"; }

namespace {

constexpr const char* kWorldDestroyed =
    "DeviceMesh: the process group it was built on was destroyed; keep the group alive as long as the mesh";

std::string dim_names(const std::vector<MeshDim>& dims) {
  std::string names;
  for (const MeshDim& d : dims) names += (names.empty() ? "'" : ", '") + d.name + "'";
  return names.empty() ? "none" : names;
}

}  // namespace

DeviceMesh::DeviceMesh(ProcessGroup& world, std::vector<MeshDim> dims, int ranks_per_node)
    : world_(world, kWorldDestroyed), dims_(std::move(dims)), ranks_per_node_(ranks_per_node == 0 ? world.size() : ranks_per_node) {
  int64_t product = 1;
  std::set<std::string> seen;
  std::string shape;
  for (const MeshDim& d : dims_) {
    ZG_CHECK(!d.name.empty() && seen.insert(d.name).second, "DeviceMesh: dimension names must be distinct and not "
             "empty, got ", dim_names(dims_));
    ZG_CHECK(d.size >= 1, "DeviceMesh: dimension '", d.name, "' has size ", d.size, "; sizes are at least 1");
    product *= d.size;
    shape += (shape.empty() ? "" : " x ") + std::to_string(d.size);
  }
  ZG_CHECK(product == world.size(), "DeviceMesh: dimensions of sizes ", shape.empty() ? "(none)" : shape,
           " hold ", product, " ranks, but the group has ", world.size());
  ZG_CHECK(ranks_per_node_ >= 1, "DeviceMesh: ranks_per_node must be >= 1 (0: one node), got ", ranks_per_node);
  // Every rank splits in the same order: one collective per dimension that is neither the
  // world nor a rank alone (a group of one, whose collectives are the identity).
  for (size_t d = 0; d < dims_.size(); ++d) {
    if (dims_[d].size == world.size()) {
      groups_.push_back(world_);
      continue;
    }
    owned_.push_back(dims_[d].size == 1 ? std::make_unique<FakeGroup>(0, 1, stride_at(d))
                                        : world.split_grid(dims_[d].size, stride_at(d)));
    groups_.emplace_back(*owned_.back(), kWorldDestroyed);
  }
}

DeviceMesh::~DeviceMesh() = default;

size_t DeviceMesh::index(std::string_view dim) const {
  for (size_t d = 0; d < dims_.size(); ++d)
    if (dims_[d].name == dim) return d;
  fail("DeviceMesh: no dimension '", dim, "'; the mesh has ", dim_names(dims_));
}

int DeviceMesh::stride_at(size_t d) const {
  int stride = 1;
  for (size_t e = d + 1; e < dims_.size(); ++e) stride *= dims_[e].size;
  return stride;
}

bool DeviceMesh::has(std::string_view dim) const {
  for (const MeshDim& d : dims_)
    if (d.name == dim) return true;
  return false;
}

int DeviceMesh::size(std::string_view dim) const { return has(dim) ? dims_[index(dim)].size : 1; }
int DeviceMesh::coordinate(std::string_view dim) const {
  return has(dim) ? world_->rank() / stride(dim) % size(dim) : 0;
}
int DeviceMesh::stride(std::string_view dim) const { return stride_at(index(dim)); }
ProcessGroup& DeviceMesh::group(std::string_view dim) const { return *groups_[index(dim)]; }

std::vector<int> DeviceMesh::members_of(const std::vector<MeshDim>& dims, int rank, size_t dim) {
  int stride = 1;
  for (size_t e = dim + 1; e < dims.size(); ++e) stride *= dims[e].size;
  const int c = rank / stride % dims.at(dim).size;
  std::vector<int> members;
  for (int j = 0; j < dims[dim].size; ++j) members.push_back(rank + (j - c) * stride);
  return members;
}

std::vector<int> DeviceMesh::members(std::string_view dim) const { return members_of(dims_, world_->rank(), index(dim)); }

Link DeviceMesh::link(std::string_view dim) const {
  const std::vector<int> ranks = members(dim);
  const int node = world_->rank() / ranks_per_node_;
  for (int q : ranks)
    if (q / ranks_per_node_ != node) return Link::across_nodes;
  return Link::within_node;
}

// Adjacent dimensions a..b are one grid: their sizes multiplied, the innermost's stride.
ProcessGroup& DeviceMesh::flatten(const std::string& name, const std::vector<std::string>& dims) {
  for (const auto& [existing, group] : flattened_)
    if (existing == name) return *group;
  ZG_CHECK(!dims.empty(), "DeviceMesh::flatten: '", name, "' names no dimensions");
  const size_t first = index(dims.front());
  int size = 1;
  for (size_t i = 0; i < dims.size(); ++i) {
    ZG_CHECK(index(dims[i]) == first + i, "DeviceMesh::flatten: '", name, "' must name adjacent dimensions in mesh "
             "order; the mesh has ", dim_names(dims_));
    size *= dims_[first + i].size;
  }
  GroupRef group = world_;
  if (dims.size() == 1) group = groups_[first];
  else if (size != world_->size()) {
    owned_.push_back(world_->split_grid(size, stride_at(first + dims.size() - 1)));
    group = GroupRef(*owned_.back(), kWorldDestroyed);
  }
  flattened_.emplace_back(name, group);
  return *group;
}

std::string DeviceMesh::describe() const {
  std::string text;
  for (const MeshDim& d : dims_) text += (text.empty() ? "" : " x ") + d.name + " " + std::to_string(d.size);
  return text + " (" + std::to_string(world_->size()) + " ranks, " + std::to_string(ranks_per_node_) + " a node)";
}

std::unique_ptr<DeviceMesh> training_mesh(ProcessGroup& world, const ParallelDims& d) {
  const int n = world.size();
  ZG_CHECK(d.pp >= 1 && n % d.pp == 0, "training_mesh: pp ", d.pp, " does not divide the ", n, " ranks");
  ZG_CHECK(d.tp >= 1 && n / d.pp % d.tp == 0, "training_mesh: tp ", d.tp, " does not divide the ", n / d.pp, " ranks",
           d.pp > 1 ? " of a pipeline stage" : "");
  ZG_CHECK(d.cp >= 1 && n / d.pp / d.tp % d.cp == 0, "training_mesh: cp ", d.cp, " does not divide the ",
           n / d.pp / d.tp, " ranks left after pp ", d.pp, " x tp ", d.tp);
  const int data = n / d.pp / d.tp / d.cp, s = d.shard_group_size == 0 ? data : d.shard_group_size;
  ZG_CHECK(s >= 1 && data % s == 0, "training_mesh: a shard group of ", s, " does not divide the ", data,
           " data-parallel ranks");
  std::vector<MeshDim> dims;
  if (d.pp > 1) dims.push_back({"pp", d.pp});
  dims.insert(dims.end(), {{"dp_replicate", data / s}, {"dp_shard", s}});
  if (d.cp > 1) dims.push_back({"cp", d.cp});
  if (d.tp > 1) dims.push_back({"tp", d.tp});
  return std::make_unique<DeviceMesh>(world, std::move(dims), d.ranks_per_node);
}

std::unique_ptr<DeviceMesh> training_mesh(ProcessGroup& world, int tp, int shard_group_size, int ranks_per_node) {
  return training_mesh(world, {.tp = tp, .shard_group_size = shard_group_size, .ranks_per_node = ranks_per_node});
}

}  // namespace zg::dist
