// ZeRO-Infinity's file tier: paged tensors come back as they went out, and a model whose
// state pages from a file (offload nvme) trains the same bits as in memory -- under a host
// budget the state itself would not fit in -- holding at most three units' state in host
// memory at a time.
#include <filesystem>
#include <unistd.h>

#include "helpers.h"

#include "dist/comm/local_group.h"
#include "tensor/file_tier.h"
#include "zero_training.h"

namespace zg::test {

namespace {

std::string scratch_folder() { return std::filesystem::temp_directory_path().string(); }

Tensor host_tensor(int64_t numel, DType dtype) {
  Tensor t = empty({numel}, TensorOptions(dtype).pinned(true));
  t.copy_(randn({numel}, DType::f32).to(dtype));
  return t;
}

// An 8-block GPT: enough units that three of them are well below the whole state.
nn::GPTConfig deep_config() {
  nn::GPTConfig c = zero_config();
  c.n_layer = 8, c.n_embd = 64;
  return c;
}

struct Run {
  nn::NamedTensors master;
  std::vector<double> losses;
  MemoryStats host;
  FileTierStats tier;
};

// Five steps of the 8-block GPT at one rank, two micro-batches, clipping; `host_budget` caps the host pool.
Run train_deep(int stage, dist::Offload offload, DType dtype, int64_t host_budget = 0) {
  Run out;
  dist::run_local(1, [&](dist::ProcessGroup& pg) {
    Context::current().host_allocator()->set_cap(host_budget);
    manual_seed(3);
    nn::GPT model(deep_config());
    dist::ShardedModel sharded(model, pg,
                               {.stage = stage, .compute_dtype = dtype, .adamw = kAdamW, .max_grad_norm = 0.05,
                                .offload = offload, .offload_dir = scratch_folder()});
    for (int s = 0; s < 5; ++s) {
      const auto [x, y] = global_batch(s);
      sharded.zero_grad();
      double loss = 0;
      for (int k = 0; k < 2; ++k) {
        Tensor l = model.forward(x.narrow(0, 2 * k, 2), y.narrow(0, 2 * k, 2)).loss * 0.5;
        l.backward();
        loss += l.item<double>();
      }
      sharded.step(1e-3);
      out.losses.push_back(loss);
    }
    for (auto& [name, t] : sharded.gathered_master()) out.master.emplace_back(name, t.clone());
    out.host = host_memory_stats();
    out.tier = sharded.file_tier_stats();
  });
  return out;
}

}  // namespace

TEST_CASE("a paged tensor comes back from the file as it went out: odd sizes, zeros, a page-in while writing") {
  auto tier = std::make_shared<FileTier>(scratch_folder(), "test", kCPU, 2);
  for (int64_t numel : {int64_t{1}, int64_t{1000}, int64_t{1 << 20}, int64_t{(1 << 20) + 3}}) {
    INFO("numel " << numel);
    Tensor t = host_tensor(numel, DType::f32);
    const Tensor kept = t.clone();
    PagedTensor paged(tier, t, "test tensor");
    paged.page_out(false);  // never written yet: written anyway
    paged.settle(true);
    CHECK(paged.state() == PagedTensor::State::out);
    CHECK(t.storage()->is_released());
    CHECK_THROWS_WITH_AS(zg::sum(t), doctest::Contains("test tensor lives in the file tier"), Error);
    paged.page_in();
    paged.wait();
    check_identical(t, kept, "read back");
    t.mul_(2.0);
    paged.page_out(true);
    paged.page_in();  // while (or after) writing: its bytes are still there
    CHECK(paged.state() == PagedTensor::State::in);
    check_identical(t, kept * 2.0, "kept while writing");
    paged.page_out(false);  // unchanged since the write: no second write
    paged.page_in();
    paged.wait();
    check_identical(t, kept * 2.0, "read after the write");
    paged.mark_zero();
    CHECK(max(abs(t)).item<double>() == 0.0);
    paged.page_out(false);
    paged.page_in();
    CHECK(paged.state() == PagedTensor::State::in);  // zeros need no read
    CHECK(max(abs(t)).item<double>() == 0.0);
  }
  const FileTierStats stats = tier->stats();
  CHECK(stats.paged_bytes == 4 * (1 + 1000 + (1 << 20) + (1 << 20) + 3));
  CHECK(stats.file_bytes % 4096 == 0);
  CHECK(stats.file_bytes >= stats.paged_bytes);
  CHECK(stats.bytes_written == 2 * stats.paged_bytes);
  CHECK(stats.bytes_read == 2 * stats.paged_bytes);
}

TEST_CASE("the file tier refuses a folder that is not there, and a dry run's tier counts without a file") {
  CHECK_THROWS_WITH_AS(FileTier("/no/such/folder", "test", kCPU), doctest::Contains("'/no/such/folder' is not a folder"),
                       Error);
  CHECK_THROWS_WITH_AS(FileTier("", "test", kCPU), doctest::Contains("--offload-dir"), Error);
  auto tier = std::make_shared<FileTier>("", "dry", kMeta);
  Tensor t = empty({1000}, TensorOptions(DType::f32).device(kMeta).pinned(true));
  PagedTensor paged(tier, t, "meta tensor");
  paged.page_out(true);
  CHECK(t.storage()->is_released());
  paged.page_in();
  CHECK(paged.state() == PagedTensor::State::in);
  CHECK(tier->stats().paged_bytes == 4000);
  CHECK(tier->stats().bytes_written == 0);
}

TEST_CASE("offload nvme under a host budget below the state trains the in-memory bits, three units at most in host "
          "memory") {
  for (DType dtype : {DType::bf16, DType::f32})
    for (int stage : {1, 3}) {
      INFO(std::string(name(dtype)) << " stage " << stage);
      const Run memory = train_deep(stage, dist::Offload::none, dtype);
      const int64_t params = [] {
        nn::GPT model(deep_config());
        int64_t n = 0;
        for (const auto& [name, p] : model.named_parameters()) n += p.numel();
        return n;
      }();
      const int64_t block = [] {  // the largest unit: one transformer block
        nn::GPT model(deep_config());
        int64_t n = 0;
        for (const auto& [name, p] : model.named_parameters()) n += name.starts_with("transformer.h.0.") ? p.numel() : 0;
        return n;
      }();
      const int64_t state = 12 * params;  // master, m, v in f32
      const int64_t budget = state / 2;
      const Run nvme = train_deep(stage, dist::Offload::nvme, dtype, budget);
      CHECK(nvme.losses == memory.losses);
      REQUIRE(nvme.master.size() == memory.master.size());
      for (size_t i = 0; i < nvme.master.size(); ++i) check_identical(nvme.master[i].second, memory.master[i].second, nvme.master[i].first);
      // The file holds the state and the gradient shard; the host held a few units of it.
      CHECK(nvme.tier.paged_bytes == (12 + element_size(dtype)) * params);  // (the gradient in the compute dtype)
      CHECK(nvme.host.peak_total <= budget);
      // Three units' master, m, v and gradient shard, and the update's staging for the device (stage 1).
      CHECK(nvme.host.peak_total <= 3 * (12 + element_size(dtype)) * block + element_size(dtype) * block);
      MESSAGE(std::string(name(dtype)) << " stage " << stage << ": host peak " << nvme.host.peak_total << " of a budget of " << budget
                          << " (state " << state << ", a block's " << 16 * block << ")");
      CHECK(nvme.tier.bytes_read > 0);
      CHECK(nvme.tier.bytes_written > 0);
      // The same budget cannot hold the state in the host pool.
      CHECK_THROWS_WITH_AS(train_deep(stage, dist::Offload::optimizer, dtype, budget),
                           doctest::Contains("out of memory on cpu (over the memory cap)"), Error);
    }
}

// A checkpoint pages the state a unit at a time too: saved and loaded under a host budget the
// whole state would not fit in (stages 1 and 3; the load at stage 1 refreshes each unit's
// compute copy while the unit is in).
TEST_CASE("offload nvme: a checkpoint saves and loads under a host budget below the state, a unit at a time") {
  const std::string dir = scratch_folder() + "/zg-infinity-budget-" + std::to_string(::getpid());
  for (int stage : {1, 3}) {
    INFO("stage " << stage);
    std::filesystem::remove_all(dir);
    nn::NamedTensors saved, loaded;
    int64_t budget = 0;
    double next_loss[2] = {0, 1};
    for (bool loading : {false, true})
      dist::run_local(1, [&](dist::ProcessGroup& pg) {
        manual_seed(loading ? 4 : 3);  // the load replaces other initial weights
        nn::GPT model(deep_config());
        int64_t params = 0;
        for (const auto& [name, p] : model.named_parameters()) params += p.numel();
        budget = 12 * params / 2;  // half of master, m, v
        Context::current().host_allocator()->set_cap(budget);
        dist::ShardedModel sharded(model, pg, {.stage = stage, .compute_dtype = DType::bf16, .adamw = kAdamW,
                                               .offload = dist::Offload::nvme, .offload_dir = scratch_folder()});
        if (loading) {
          sharded.load(dir);
        } else {
          for (int s = 0; s < 2; ++s) {
            const auto [x, y] = global_batch(s);
            sharded.zero_grad();
            model.forward(x, y).loss.backward();
            sharded.step(1e-3);
          }
          sharded.save(dir);
        }
        CHECK(host_memory_stats().peak_total <= budget);
        nn::NamedTensors master = sharded.gathered_master();
        (loading ? loaded : saved) = std::move(master);
        // The next forward reads compute weights refreshed from the loaded master: the saver's loss.
        const auto [x, y] = global_batch(2);
        next_loss[loading] = model.forward(x, y).loss.item<double>();
      });
    CHECK(next_loss[1] == next_loss[0]);
    REQUIRE(saved.size() == loaded.size());
    for (size_t i = 0; i < saved.size(); ++i) check_identical(saved[i].second, loaded[i].second, saved[i].first);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("offload nvme: a checkpoint saved from the file tier loads in memory, and back, the same bits") {
  const std::string dir = scratch_folder() + "/zg-infinity-ckpt-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  nn::NamedTensors saved, loaded;
  for (dist::Offload offload : {dist::Offload::nvme, dist::Offload::none, dist::Offload::nvme})
    dist::run_local(2, [&](dist::ProcessGroup& pg) {
      manual_seed(3);
      nn::GPT model(deep_config());
      dist::ShardedModel sharded(model, pg, {.stage = 3, .adamw = kAdamW, .offload = offload, .offload_dir = scratch_folder()});
      if (std::filesystem::exists(dir)) sharded.load(dir);
      const auto [x, y] = global_batch(static_cast<int>(sharded.steps()));
      sharded.zero_grad();
      model.forward(x.narrow(0, 2 * pg.rank(), 2), y.narrow(0, 2 * pg.rank(), 2)).loss.backward();
      sharded.step(1e-3);
      sharded.save(dir);
      nn::NamedTensors master = sharded.gathered_master();  // (a collective)
      if (pg.rank() == 0) saved = std::move(master);
    });
  // Three steps through save and load, nvme -> memory -> nvme; and three in memory alone.
  dist::run_local(2, [&](dist::ProcessGroup& pg) {
    manual_seed(3);
    nn::GPT model(deep_config());
    dist::ShardedModel sharded(model, pg, {.stage = 3, .adamw = kAdamW});
    for (int s = 0; s < 3; ++s) {
      const auto [x, y] = global_batch(s);
      sharded.zero_grad();
      model.forward(x.narrow(0, 2 * pg.rank(), 2), y.narrow(0, 2 * pg.rank(), 2)).loss.backward();
      sharded.step(1e-3);
    }
    nn::NamedTensors master = sharded.gathered_master();
    if (pg.rank() == 0) loaded = std::move(master);
  });
  REQUIRE(saved.size() == loaded.size());
  for (size_t i = 0; i < saved.size(); ++i) check_identical(saved[i].second, loaded[i].second, saved[i].first);
  std::filesystem::remove_all(dir);
}

}  // namespace zg::test
