// Memory accounting: exact bytes per category, peaks, scopes, and per-rank
// independence when ranks are threads of one process.
#include <optional>
#include <thread>

#include "dist/comm/local_group.h"
#include "figures.h"
#include "helpers.h"
#include "tiny_gpt.h"

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

TEST_CASE("a memory timeline keeps at most its capacity, says how much it dropped, and notes nothing when off") {
  Context rank;
  ContextGuard guard(rank);
  MemoryTimeline timeline(8);
  const Tensor before = empty({4});  // no recording yet: not noted
  {
    MemoryTimelineRecording recording(timeline);
    MemoryTimeline other;
    CHECK_THROWS_WITH_AS(MemoryTimelineRecording{other},
                         "MemoryTimelineRecording: another recording is in progress; end it first (one at a time)",
                         Error);
    for (int i = 0; i < 10; ++i) empty({16});
  }
  CHECK(timeline.events().size() == 8);
  CHECK(timeline.dropped() >= 12);  // ten allocations and ten frees, at least
  const Tensor after = empty({4});  // the recording ended
  CHECK(timeline.events().size() == 8);
  CHECK_THROWS_WITH_AS(timeline.path(99), "MemoryTimeline: no path numbered 99 (0 recorded)", Error);
  CHECK_THROWS_WITH_AS(memory_figure_svg({}, "nothing"), "memory_figure_svg: no panels to draw", Error);
}

// A trace's slices all end: a range still open when the recording ends is closed there,
// and a range is kept only with room for its end.
TEST_CASE("a memory timeline closes every range it keeps: at the recording's end, and within its capacity") {
  Context rank;
  ContextGuard guard(rank);
  MemoryTimeline held;  // what every allocator holds as a recording begins: its first events
  { MemoryTimelineRecording recording(held); }
  int held_allocations = 0;
  for (const TimelineEvent& e : held.events()) held_allocations += e.kind == TimelineEvent::Kind::allocate;
  MemoryTimeline timeline(held.events().size() + 6);
  std::optional<MemoryTimelineRecording> recording(std::in_place, timeline);
  std::optional<TraceRange> outer(std::in_place, "outer");
  {
    TraceRange inner("inner");
    for (int i = 0; i < 10; ++i) empty({16});  // the first kept, then no room but for two ends
    TraceRange late("late");                   // no room for it and its end: dropped
  }
  recording.reset();  // with "outer" open
  outer.reset();
  std::vector<std::string> begun;
  int depth = 0, allocations = 0;
  for (const TimelineEvent& e : timeline.events()) {
    if (e.kind == TimelineEvent::Kind::begin) ++depth, begun.push_back(timeline.path(e.path));
    if (e.kind == TimelineEvent::Kind::end) CHECK(--depth >= 0);
    allocations += e.kind == TimelineEvent::Kind::allocate;
  }
  CHECK(depth == 0);
  CHECK(begun == std::vector<std::string>{"outer", "outer > inner"});
  CHECK(allocations == held_allocations + 1);  // the first tensor's, before the room left was for ends only
  CHECK(timeline.events().size() == timeline.capacity());
  CHECK(timeline.events().back().kind == TimelineEvent::Kind::end);  // outer's, at the recording's end
  CHECK(timeline.dropped() >= 20);
}

// A thread names its row: the comm worker's "communication"; one that names none is "compute".
TEST_CASE("chrome_trace_json names each thread's row as the thread named itself, else compute") {
  Context rank;
  ContextGuard guard(rank);
  MemoryTimeline timeline;
  {
    MemoryTimelineRecording recording(timeline);
    TraceRange step("step");
    std::thread([&rank] {
      set_trace_thread_name("loader");
      ContextGuard same(rank);
      TraceRange read("read");
    }).join();
  }
  std::map<std::string, std::string> rows;  // a row's name -> the slice on it
  std::map<int, std::string> names;
  const nlohmann::json trace = nlohmann::json::parse(chrome_trace_json(timeline));
  for (const auto& e : trace.at("traceEvents"))
    if (e.at("ph") == "M" && e.at("name") == "thread_name") names[e.at("tid")] = e.at("args").at("name");
  for (const auto& e : trace.at("traceEvents"))
    if (e.at("ph") == "B") rows[names.at(e.at("tid"))] = e.at("name");
  CHECK(rows == std::map<std::string, std::string>{{"compute", "step"}, {"loader", "read"}});
}

// Two ranks (threads) train the tiny GPT under ZeRO-3 while one timeline records both:
// each rank's sums, its trace's counters and its figure's drawn peak are its allocator's
// figures, and the phases name the units.
TEST_CASE("a memory timeline's sums, trace and figure are each rank's allocator figures") {
  MemoryTimeline timeline;
  std::optional<MemoryTimelineRecording> recording;
  std::vector<MemoryStats> stats(2);
  const Sequence data = fixed_sequence();
  dist::run_local(2, [&](dist::ProcessGroup& group) {
    manual_seed(1);
    nn::GPT model(tiny_config());
    dist::ShardedModel sharded(model, group, {.stage = 3});
    group.barrier();
    if (group.rank() == 0) recording.emplace(timeline);
    group.barrier();
    Context::current().allocator(kCPU)->reset_peaks();
    for (int step = 0; step < 2; ++step) {
      sharded.zero_grad();
      {
        MemoryScope scope(MemoryCategory::activation);
        model.forward(data.inputs, data.targets).loss.backward();
      }
      sharded.step(1e-3);
    }
    stats[static_cast<size_t>(group.rank())] = memory_stats(kCPU);
    group.barrier();
    if (group.rank() == 0) recording.reset();
  });
  REQUIRE(timeline.dropped() == 0);
  std::vector<MemoryPanel> panels;
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    const MemorySeries series = memory_series(timeline, r, kCPU);
    REQUIRE(!series.x.empty());
    CHECK(series.peak() == stats[r].peak_total);
    for (int c = 0; c < kMemoryCategories; ++c) CHECK(series.peak_of(static_cast<MemoryCategory>(c)) == stats[r].peak[c]);
    std::map<std::string, int> phases;  // forward: the modules' ranges at the top of the rank's threads
    for (const MemorySeries::Phase& phase : series.phases) ++phases[phase.name];
    CHECK(phases["backward"] == 2);
    CHECK(phases["optimizer"] == 2);
    CHECK(phases["forward"] >= 2);
    panels.push_back({"rank " + std::to_string(r), series, {}, true});
  }
  // Where the bytes were taken: a forward of unit h.0, the backward of h.1 (named after
  // its forward), a ZeRO-3 gather, the optimizer.
  const auto noted_under = [&](const std::function<bool(const std::string&)>& matches) {
    for (const TimelineEvent& e : timeline.events())
      if (e.kind == TimelineEvent::Kind::allocate && matches(timeline.path(e.path))) return true;
    return false;
  };
  const auto has = [](const std::string& path, const char* part) { return path.find(part) != std::string::npos; };
  CHECK(noted_under([&](const std::string& p) { return !p.starts_with("backward") && has(p, "h.0 (Block) > attn"); }));
  CHECK(noted_under([&](const std::string& p) { return p.starts_with("backward > ") && has(p, "h.1 (Block) > mlp"); }));
  CHECK(noted_under([&](const std::string& p) { return has(p, "gather transformer.h.1"); }));
  CHECK(noted_under([&](const std::string& p) { return p.starts_with("optimizer"); }));

  const nlohmann::json trace = nlohmann::json::parse(chrome_trace_json(timeline));
  std::map<std::pair<int, int>, int> open;  // (rank, thread): ranges begun and not ended
  bool counters[kMemoryCategories] = {};
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") == "B") ++open[{e.at("pid"), e.at("tid")}];
    if (e.at("ph") == "E") CHECK(--open[{e.at("pid"), e.at("tid")}] >= 0);
    if (e.at("ph") == "C")
      for (int c = 0; c < kMemoryCategories; ++c)
        counters[c] = counters[c] || e.at("name") == std::string("cpu ") + name(static_cast<MemoryCategory>(c));
  }
  for (MemoryCategory c : {MemoryCategory::parameter, MemoryCategory::gradient, MemoryCategory::optimizer_state,
                           MemoryCategory::activation, MemoryCategory::communication})
    CHECK(counters[static_cast<int>(c)]);
  const std::vector<DrawnPanel> drawn = drawn_panels(memory_figure_svg(panels, "two ranks, ZeRO-3"));
  REQUIRE(drawn.size() == 2);
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    CHECK(trace_peak(trace, r, "cpu") == stats[r].peak_total);
    CHECK(drawn[r].peak_attribute == stats[r].peak_total);
    CHECK(drawn[r].areas >= 5);
    // Coordinates carry two decimals: the top of the stack is the peak to within 0.005 px.
    CHECK(std::fabs(drawn[r].drawn_peak() - static_cast<double>(stats[r].peak_total)) <= 0.006 * drawn[r].bytes_per_px);
  }
}

}  // namespace zg::test
