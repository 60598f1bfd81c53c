// The device mesh: named dimensions over the world, each a process group, checked
// against the mesh formula on the fake group (a dry run is rank r of any mesh) and on
// real groups (threads); ZeRO over a mesh equals ZeRO over a group and a shard size.
#include <doctest/doctest.h>

#include "dist/comm/device_mesh.h"
#include "dist/comm/fake_group.h"
#include "dist/comm/local_group.h"
#include "zero_training.h"

namespace zg::test {

namespace {

// The mesh formula by brute force: the ranks whose coordinates equal r's but along `dim`,
// in order of their coordinate along it (row-major, the last dimension fastest).
std::vector<int> members_by_search(const std::vector<dist::MeshDim>& dims, int r, size_t dim) {
  const auto coordinates = [&](int q) {
    std::vector<int> c(dims.size());
    for (size_t d = dims.size(); d-- > 0;) {
      c[d] = q % dims[d].size;
      q /= dims[d].size;
    }
    return c;
  };
  int world = 1;
  for (const dist::MeshDim& d : dims) world *= d.size;
  std::vector<int> members(static_cast<size_t>(dims[dim].size), -1);
  const std::vector<int> mine = coordinates(r);
  for (int q = 0; q < world; ++q) {
    std::vector<int> theirs = coordinates(q);
    const int along = theirs[dim];
    theirs[dim] = mine[dim];
    if (theirs == mine) members[static_cast<size_t>(along)] = q;
  }
  return members;
}

}  // namespace

TEST_CASE("a dry run of rank r of a 2 x 2 x 2 mesh builds each dimension's group by the mesh formula, every r") {
  const std::vector<dist::MeshDim> dims = {{"pp", 2}, {"dp", 2}, {"tp", 2}};
  for (int r = 0; r < 8; ++r) {
    INFO("rank " << r);
    dist::FakeGroup world(r, 8);
    dist::DeviceMesh mesh(world, dims, /*ranks_per_node=*/4);
    CHECK(mesh.describe() == "pp 2 x dp 2 x tp 2 (8 ranks, 4 a node)");
    for (size_t d = 0; d < dims.size(); ++d) {
      const std::string& name = dims[d].name;
      INFO("dimension " << name);
      const std::vector<int> members = mesh.members(name);
      CHECK(members == members_by_search(dims, r, d));
      CHECK(members == dist::DeviceMesh::members_of(dims, r, d));
      const auto& group = dynamic_cast<const dist::FakeGroup&>(mesh.group(name));
      CHECK(group.size() == 2);
      CHECK(group.rank() == mesh.coordinate(name));
      CHECK(members[static_cast<size_t>(group.rank())] == r);
      CHECK(group.stride() == mesh.stride(name));  // what the step model reads of a group
      CHECK(members[1] - members[0] == mesh.stride(name));
    }
    CHECK(mesh.stride("pp") == 4);
    CHECK(mesh.stride("tp") == 1);
    // Four ranks a node: tp and dp stay within it, pp crosses.
    CHECK(mesh.link("tp") == dist::Link::within_node);
    CHECK(mesh.link("dp") == dist::Link::within_node);
    CHECK(mesh.link("pp") == dist::Link::across_nodes);
    // dp x tp as one group: the 4 ranks of r's node, ranked r % 4.
    dist::ProcessGroup& dp_tp = mesh.flatten("dp_tp", {"dp", "tp"});
    CHECK((dp_tp.size() == 4 && dp_tp.rank() == r % 4));
    CHECK(&mesh.flatten("dp_tp", {"dp", "tp"}) == &dp_tp);  // made once
  }
  // Dimensions a mesh lacks have size 1 and coordinate 0; asking for their group names the ones there are.
  dist::FakeGroup world(3, 8);
  dist::DeviceMesh mesh(world, {{"dp_replicate", 2}, {"dp_shard", 4}});
  CHECK((mesh.size("tp") == 1 && mesh.coordinate("tp") == 0 && !mesh.has("tp")));
  CHECK(mesh.coordinate("dp_shard") == 3);
  CHECK(mesh.link("dp_replicate") == dist::Link::within_node);  // one node by default
  CHECK_THROWS_WITH_AS(mesh.group("tp"), "DeviceMesh: no dimension 'tp'; the mesh has 'dp_replicate', 'dp_shard'",
                       Error);
}

TEST_CASE("a 4-D mesh with a dimension of one, and the mesh's errors") {
  const std::vector<dist::MeshDim> dims = {{"pp", 2}, {"dp_replicate", 1}, {"dp_shard", 3}, {"tp", 2}};
  for (int r = 0; r < 12; ++r) {
    dist::FakeGroup world(r, 12);
    dist::DeviceMesh mesh(world, dims);
    for (size_t d = 0; d < dims.size(); ++d) {
      CHECK(mesh.members(dims[d].name) == members_by_search(dims, r, d));
      CHECK(mesh.group(dims[d].name).size() == dims[d].size);
      CHECK(mesh.group(dims[d].name).rank() == mesh.coordinate(dims[d].name));
    }
  }
  dist::FakeGroup world(0, 8);
  CHECK_THROWS_WITH_AS(dist::DeviceMesh(world, {{"dp", 2}, {"tp", 2}}),
                       "DeviceMesh: dimensions of sizes 2 x 2 hold 4 ranks, but the group has 8", Error);
  CHECK_THROWS_WITH_AS(dist::DeviceMesh(world, {{"dp", 2}, {"dp", 4}}),
                       "DeviceMesh: dimension names must be distinct and not empty, got 'dp', 'dp'", Error);
  CHECK_THROWS_WITH_AS(dist::DeviceMesh(world, {{"dp", 0}, {"tp", 8}}),
                       "DeviceMesh: dimension 'dp' has size 0; sizes are at least 1", Error);
  dist::DeviceMesh mesh(world, {{"pp", 2}, {"dp", 2}, {"tp", 2}});
  CHECK_THROWS_WITH_AS(mesh.flatten("pp_tp", {"pp", "tp"}),
                       "DeviceMesh::flatten: 'pp_tp' must name adjacent dimensions in mesh order; the mesh has 'pp', "
                       "'dp', 'tp'",
                       Error);
}

TEST_CASE("training_mesh: [pp x] dp_replicate x dp_shard [x tp], pp outermost, tp innermost, and what does not divide") {
  dist::FakeGroup world(5, 16);
  const auto dims_of = [](const dist::DeviceMesh& mesh) {
    std::string text;
    for (const dist::MeshDim& d : mesh.dims()) text += d.name + " " + std::to_string(d.size) + "; ";
    return text;
  };
  CHECK(dims_of(*dist::training_mesh(world)) == "dp_replicate 1; dp_shard 16; ");
  CHECK(dims_of(*dist::training_mesh(world, 1, 4)) == "dp_replicate 4; dp_shard 4; ");
  const std::unique_ptr<dist::DeviceMesh> mesh = dist::training_mesh(world, 4, 2);
  CHECK(dims_of(*mesh) == "dp_replicate 2; dp_shard 2; tp 4; ");
  CHECK(mesh->members("tp") == std::vector<int>{4, 5, 6, 7});  // consecutive ranks
  CHECK(dims_of(*dist::training_mesh(world, 8)) == "dp_replicate 1; dp_shard 2; tp 8; ");
  CHECK_THROWS_WITH_AS(dist::training_mesh(world, 3), "training_mesh: tp 3 does not divide the 16 ranks", Error);
  CHECK_THROWS_WITH_AS(dist::training_mesh(world, 4, 3),
                       "training_mesh: a shard group of 3 does not divide the 4 data-parallel ranks", Error);
  const std::unique_ptr<dist::DeviceMesh> pipelined = dist::training_mesh(world, {.pp = 4, .tp = 2});
  CHECK(dims_of(*pipelined) == "pp 4; dp_replicate 1; dp_shard 2; tp 2; ");
  CHECK(pipelined->members("pp") == std::vector<int>{1, 5, 9, 13});  // a stage's ranks are consecutive
  CHECK_THROWS_WITH_AS(dist::training_mesh(world, {.pp = 4, .tp = 8}),
                       "training_mesh: tp 8 does not divide the 4 ranks of a pipeline stage", Error);
}

TEST_CASE("on threads, each dimension's group holds the ranks of the mesh formula and reduces among them alone") {
  const std::vector<dist::MeshDim> dims = {{"pp", 2}, {"dp", 2}, {"tp", 2}};
  dist::run_local(8, [&](dist::ProcessGroup& world) {
    dist::DeviceMesh mesh(world, dims);
    for (size_t d = 0; d < dims.size(); ++d) {
      dist::ProcessGroup& group = mesh.group(dims[d].name);
      Tensor ranks = zeros({2}, DType::i64);
      group.all_gather(tensor<int64_t>({world.rank()}), ranks);
      const std::vector<int> members = mesh.members(dims[d].name);
      CHECK(ranks.to_vector<int64_t>() == std::vector<int64_t>(members.begin(), members.end()));
      Tensor sum = tensor<float>({float(world.rank())});
      group.all_reduce(sum);
      CHECK(sum.item<float>() == float(members[0] + members[1]));
    }
    Tensor all = zeros({4}, DType::i64);
    mesh.flatten("dp_tp", {"dp", "tp"}).all_gather(tensor<int64_t>({world.rank()}), all);
    const int node = world.rank() / 4 * 4;
    CHECK(all.to_vector<int64_t>() == std::vector<int64_t>{node, node + 1, node + 2, node + 3});
  });
}

TEST_CASE("ZeRO over a dp_replicate x dp_shard mesh trains as over a group with shard_group_size, bit for bit") {
  const auto train = [](bool over_mesh, int stage) {
    nn::NamedTensors result;
    dist::run_local(4, [&](dist::ProcessGroup& pg) {
      manual_seed(1);
      nn::GPT model(zero_config());
      dist::DeviceMesh mesh(pg, {{"dp_replicate", 2}, {"dp_shard", 2}});
      const dist::ZeroConfig config{.stage = stage, .compute_dtype = DType::f32, .adamw = kAdamW};
      dist::ZeroConfig hybrid = config;
      hybrid.shard_group_size = 2;
      std::unique_ptr<dist::ShardedModel> sharded = over_mesh ? std::make_unique<dist::ShardedModel>(model, mesh, config)
                                                              : std::make_unique<dist::ShardedModel>(model, pg, hybrid);
      CHECK(sharded->shard_group().size() == 2);
      CHECK(sharded->replica_group()->size() == 2);
      CHECK(sharded->config().shard_group_size == 2);
      for (int s = 0; s < 3; ++s) {
        const auto [x, y] = global_batch(s);
        sharded->zero_grad();
        model.forward(x.narrow(0, pg.rank(), 1), y.narrow(0, pg.rank(), 1)).loss.backward();
        sharded->step(1e-3);
      }
      const nn::NamedTensors master = sharded->gathered_master();
      if (pg.rank() == 3) result = master;
    });
    return result;
  };
  for (int stage : {2, 3}) {
    const nn::NamedTensors a = train(true, stage), b = train(false, stage);
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) CHECK(a[i].second.to_vector<float>() == b[i].second.to_vector<float>());
  }
  // A mesh with a dimension ZeRO does not shard over, or a shard size that disagrees, is refused.
  dist::run_local(2, [](dist::ProcessGroup& pg) {
    manual_seed(1);
    nn::GPT model(zero_config());
    dist::DeviceMesh ep(pg, {{"ep", 2}});
    CHECK_THROWS_WITH_AS(dist::ShardedModel(model, ep, {.stage = 3}),
                         "ShardedModel: the mesh's dimension 'ep' is neither data, context, tensor nor pipeline "
                         "parallel; ZeRO shards over a mesh of dp_replicate x dp_shard, with cp for a model whose "
                         "sequences parallelize_context cut, tp for one cut by parallelize_module and pp for a pipeline "
                         "stage's chunks",
                         Error);
    dist::DeviceMesh pp(pg, {{"pp", 2}});
    CHECK_THROWS_WITH_AS(dist::ShardedModel(model, pp, {.stage = 3}),
                         "ShardedModel: the mesh pp 2 (2 ranks, 2 a node) has no dp_shard dimension, which the units "
                         "shard over (size 1: every rank of a stage holds them whole)",
                         Error);
    dist::DeviceMesh inner(pg, {{"dp_shard", 1}, {"pp", 2}});
    CHECK_THROWS_WITH_AS(dist::ShardedModel(model, inner, {.stage = 3}),
                         "ShardedModel: pp must be the outermost dimension of the mesh, not as in dp_shard 1 x pp 2 "
                         "(2 ranks, 2 a node)",
                         Error);
    dist::DeviceMesh dp(pg, {{"dp_shard", 2}});
    CHECK_THROWS_WITH_AS(dist::ShardedModel(model, dp, {.stage = 3, .shard_group_size = 1}),
                         "ShardedModel: shard_group_size 1 differs from the mesh's dp_shard size 2 (leave it 0 with a "
                         "mesh)",
                         Error);
  });
}

}  // namespace zg::test
