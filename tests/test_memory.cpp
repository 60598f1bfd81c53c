// Memory accounting: exact bytes per category, peaks, scopes, and per-rank
// independence when ranks are threads of one process.
#include <thread>

#include "helpers.h"

namespace zg::test {

TEST_CASE("a 1000-element f32 tensor under the activation scope adds exactly 4000 bytes") {
  Context rank;
  ContextGuard guard(rank);
  const MemoryStats before = memory_stats();
  {
    MemoryScope scope(MemoryCategory::activation);
    const Tensor t = empty({1000});
    const MemoryStats during = memory_stats();
    CHECK(during[MemoryCategory::activation] - before[MemoryCategory::activation] == 4000);
    CHECK(during.allocated_total - before.allocated_total == 4000);
    CHECK(during[MemoryCategory::other] == before[MemoryCategory::other]);
    CHECK(during.reserved >= during.allocated_total);
    // Views share the bytes: nothing new is counted.
    const Tensor v = t.view({10, 100}).t().narrow(0, 0, 5);
    CHECK(memory_stats().allocated_total == during.allocated_total);
  }
  const MemoryStats after = memory_stats();
  CHECK(after[MemoryCategory::activation] == before[MemoryCategory::activation]);
  CHECK(after.allocated_total == before.allocated_total);
  CHECK(after.peak_of(MemoryCategory::activation) == 4000);
}

TEST_CASE("scopes nest and default to other") {
  Context rank;
  ContextGuard guard(rank);
  CHECK(MemoryScope::current() == MemoryCategory::other);
  Tensor p, g, o;
  {
    MemoryScope params(MemoryCategory::parameter);
    p = empty({10}, DType::f64);
    {
      MemoryScope grads(MemoryCategory::gradient);
      g = empty({10}, DType::bf16);
    }
    CHECK(MemoryScope::current() == MemoryCategory::parameter);
  }
  o = empty({3}, DType::i32);
  const MemoryStats s = memory_stats();
  CHECK(s[MemoryCategory::parameter] == 80);
  CHECK(s[MemoryCategory::gradient] == 20);
  CHECK(s[MemoryCategory::other] == 12);
  CHECK(s.allocated_total == 112);
  CHECK(p.storage()->category() == MemoryCategory::parameter);
}

TEST_CASE("peaks track the high-water mark and can be reset") {
  Context rank;
  ContextGuard guard(rank);
  MemoryScope scope(MemoryCategory::activation);
  {
    const Tensor a = empty({250});  // 1000 bytes
    {
      const Tensor b = empty({500});  // 2000 bytes
    }
    const Tensor c = empty({100});  // 400 bytes
    const MemoryStats s = memory_stats();
    CHECK(s[MemoryCategory::activation] == 1400);
    CHECK(s.peak_of(MemoryCategory::activation) == 3000);
    CHECK(s.peak_total == 3000);
    rank.allocator(kCPU)->reset_peaks();
    CHECK(memory_stats().peak_of(MemoryCategory::activation) == 1400);
  }
  CHECK(memory_stats().peak_of(MemoryCategory::activation) == 1400);
  CHECK(memory_stats().allocations == 3);
}

TEST_CASE("two ranks in two threads see independent figures") {
  auto work = [](int64_t elements, MemoryCategory category, MemoryStats& result) {
    Context rank;
    ContextGuard guard(rank);
    MemoryScope scope(category);
    std::vector<Tensor> keep;
    for (int i = 0; i < 50; ++i) keep.push_back(zeros({elements}));
    result = memory_stats();
  };
  MemoryStats r0, r1;
  std::thread t0(work, 100, MemoryCategory::parameter, std::ref(r0));
  std::thread t1(work, 300, MemoryCategory::gradient, std::ref(r1));
  t0.join();
  t1.join();
  CHECK(r0[MemoryCategory::parameter] == 50 * 400);
  CHECK(r0[MemoryCategory::gradient] == 0);
  CHECK(r1[MemoryCategory::gradient] == 50 * 1200);
  CHECK(r1[MemoryCategory::parameter] == 0);
  CHECK(r0.allocated_total == 50 * 400);
  CHECK(r1.allocated_total == 50 * 1200);
}

TEST_CASE("bytes return to the rank that allocated them, whichever thread frees them") {
  Context rank;
  Tensor t;
  {
    ContextGuard guard(rank);
    t = empty({64});
  }
  std::thread([&t] { t = Tensor(); }).join();
  CHECK(rank.memory_stats().allocated_total == 0);
}

TEST_CASE("release and materialize move a storage's bytes in and out of the figures") {
  Context rank;
  ContextGuard guard(rank);
  MemoryScope scope(MemoryCategory::communication);
  Tensor unit = empty({256});
  CHECK(memory_stats()[MemoryCategory::communication] == 1024);
  unit.storage()->release();
  CHECK(memory_stats()[MemoryCategory::communication] == 0);
  unit.storage()->materialize();
  CHECK(memory_stats()[MemoryCategory::communication] == 1024);
}

TEST_CASE("a memory cap simulates a smaller device") {
  Context rank;
  ContextGuard guard(rank);
  rank.allocator(kCPU)->set_cap(4096);
  MemoryScope scope(MemoryCategory::activation);
  const Tensor a = empty({512});  // 2048 bytes
  CHECK_THROWS_WITH_AS(empty({1024}),
                       "out of memory on cpu (over the memory cap): tried to allocate 4.00 KiB for activation; "
                       "reserved 2.00 KiB of a cap of 4.00 KiB, allocated 2.00 KiB, largest free block 0 B; "
                       "by category, allocated (reserved): activation 2.00 KiB (2.00 KiB)",
                       OutOfMemory);
  CHECK(memory_stats().allocated_total == 2048);  // the failed allocation left nothing behind
  const Tensor b = empty({512});
  CHECK(memory_stats().allocated_total == 4096);
}

TEST_CASE("the memory report lists every category") {
  Context rank;
  ContextGuard guard(rank);
  MemoryScope scope(MemoryCategory::optimizer_state);
  const Tensor m = empty({1024});
  const std::string report = memory_report(memory_stats(), "rank 0, cpu");
  CHECK(report.find("optimizer_state") != std::string::npos);
  CHECK(report.find("4.00 KiB") != std::string::npos);
  CHECK(report.find("communication") != std::string::npos);
}

}  // namespace zg::test
