// The caching allocator's logic on a fake device (host memory, stream markers completed
// by hand), so every case runs in every build, with or without a GPU. The same core runs
// on a GPU behind cudaMalloc and CUDA events (GPU cases: test_cuda.cpp).
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "cuda/caching_allocator_core.h"
#include "cuda/lru_cache.h"
#include "cuda/simulated_device.h"
#include "helpers.h"

namespace zg::test {

using cuda::CachingAllocator;
using cuda::StreamId;

constexpr int64_t KiB = 1024;
constexpr int64_t MiB = 1024 * KiB;
constexpr StreamId kCompute{1};
constexpr StreamId kComm{2};
constexpr StreamId kOther{3};

// A device made of host memory. Its streams' work "finishes" when the test says so.
struct FakeDevice {
  int64_t capacity = int64_t{1} << 40;  // bytes it can hand out
  int64_t in_use = 0;
  std::map<void*, int64_t> segments;
  StreamId stream = kCompute;  // the caller's current stream
  std::vector<std::pair<StreamId, std::shared_ptr<bool>>> markers;
  int waits = 0;  // times the host waited for a marker (the work then finished)

  ~FakeDevice() {
    for (const auto& [ptr, bytes] : segments) ::operator delete(ptr, std::align_val_t{512});
  }
  // Every marker recorded on `s` so far is passed.
  void finish(StreamId s) {
    for (auto& [marked, done] : markers)
      if (marked == s) *done = true;
  }
};

class FakeSource final : public cuda::MemorySource {
 public:
  explicit FakeSource(FakeDevice& device) : device_(device) {}
  void* allocate_segment(int64_t bytes) override {
    if (device_.in_use + bytes > device_.capacity) return nullptr;
    void* ptr = ::operator new(static_cast<size_t>(bytes), std::align_val_t{512});
    device_.segments[ptr] = bytes;
    device_.in_use += bytes;
    return ptr;
  }
  void free_segment(void* ptr) override {
    const auto it = device_.segments.find(ptr);
    REQUIRE(it != device_.segments.end());
    device_.in_use -= it->second;
    device_.segments.erase(it);
    ::operator delete(ptr, std::align_val_t{512});
  }
  StreamId current_stream() override { return device_.stream; }
  std::unique_ptr<cuda::StreamMarker> mark(StreamId stream) override {
    struct Marker final : cuda::StreamMarker {
      std::shared_ptr<bool> passed = std::make_shared<bool>(false);
      int* waits = nullptr;
      bool done() const override { return *passed; }
      void wait() const override {
        if (!*passed) ++*waits;
        *passed = true;
      }
    };
    auto marker = std::make_unique<Marker>();
    marker->waits = &device_.waits;
    device_.markers.emplace_back(stream, marker->passed);
    return marker;
  }

 private:
  FakeDevice& device_;
};

// The device outlives the allocator, so a test can see what the allocator gave back.
struct Fixture {
  FakeDevice device;
  std::shared_ptr<CachingAllocator> allocator;
  explicit Fixture(size_t history = CachingAllocator::kDefaultHistory)
      : allocator(std::make_shared<CachingAllocator>(kCUDA, std::make_unique<FakeSource>(device), history)) {}

  Allocation alloc(int64_t bytes, MemoryCategory category = MemoryCategory::activation) {
    return allocator->allocate(bytes, category);
  }
  void free(const Allocation& block) { allocator->deallocate(block); }
  MemoryStats stats() const { return allocator->stats(); }
};

char* at(const Allocation& block) { return static_cast<char*>(block.ptr); }

TEST_CASE("requests round up to 512 B; small ones share 2 MiB segments, large ones get 20 MiB or their own") {
  CHECK(CachingAllocator::round_size(1) == 512);
  CHECK(CachingAllocator::round_size(512) == 512);
  CHECK(CachingAllocator::round_size(513) == 1024);
  CHECK(CachingAllocator::segment_size(1 * MiB) == 2 * MiB);
  CHECK(CachingAllocator::segment_size(1 * MiB + 512) == 20 * MiB);
  CHECK(CachingAllocator::segment_size(10 * MiB - 512) == 20 * MiB);
  CHECK(CachingAllocator::segment_size(10 * MiB) == 10 * MiB);
  CHECK(CachingAllocator::segment_size(10 * MiB + 512) == 12 * MiB);

  Fixture f;
  const Allocation a = f.alloc(1);
  CHECK(f.stats().reserved == 2 * MiB);
  CHECK(f.stats().reserved_of(MemoryCategory::activation) == 512);
  CHECK(f.stats()[MemoryCategory::activation] == 1);
  const Allocation b = f.alloc(1 * MiB);  // still small: the same segment
  CHECK(at(b) == at(a) + 512);
  CHECK(f.stats().segment_allocations == 1);
  const Allocation c = f.alloc(1 * MiB + 1);  // large: a 20 MiB segment
  CHECK(f.stats().segment_allocations == 2);
  CHECK(f.stats().reserved == 22 * MiB);
  const Allocation d = f.alloc(2 * MiB);  // large: the rest of that segment
  CHECK(at(d) == at(c) + CachingAllocator::round_size(1 * MiB + 1));
  CHECK(f.stats().segment_allocations == 2);
  const Allocation e = f.alloc(18 * MiB + 1);  // more than that segment's rest: its own, of 20 MiB
  CHECK(f.stats().reserved == 42 * MiB);
  CHECK(f.device.segments.size() == 3);

  // A freed small block never serves a large request, and the reverse.
  f.free(b);
  const Allocation large = f.alloc(1 * MiB + 1);
  CHECK(f.device.segments.count(at(a)) == 1);
  CHECK((at(large) < at(a) || at(large) >= at(a) + 2 * MiB));
  f.free(c);
  const Allocation small = f.alloc(1 * MiB);
  CHECK(at(small) == at(b));
  for (const Allocation& block : {a, d, e, large, small}) f.free(block);
  CHECK(f.stats().allocated_total == 0);
}

TEST_CASE("best fit: the smallest free block that fits, on the request's stream") {
  Fixture f;
  // Free holes of 4, 16 and 8 KiB, kept apart by allocated separators.
  const Allocation hole4 = f.alloc(4 * KiB), s1 = f.alloc(512);
  const Allocation hole16 = f.alloc(16 * KiB), s2 = f.alloc(512);
  const Allocation hole8 = f.alloc(8 * KiB), s3 = f.alloc(512);
  for (const Allocation& hole : {hole4, hole16, hole8}) f.free(hole);

  const Allocation six = f.alloc(6 * KiB);
  CHECK(at(six) == at(hole8));  // not the 16 KiB hole, not the segment's tail
  const Allocation three = f.alloc(3 * KiB);
  CHECK(at(three) == at(hole4));
  const Allocation twelve = f.alloc(12 * KiB);
  CHECK(at(twelve) == at(hole16));
  const Allocation more = f.alloc(4 * KiB);  // the 16 KiB hole's rest (4 KiB) is the best fit now
  CHECK(at(more) == at(hole16) + 12 * KiB);
  CHECK(f.stats().segment_allocations == 1);
  for (const Allocation& block : {s1, s2, s3, six, three, twelve, more}) f.free(block);
}

TEST_CASE("a split block merges with its free neighbours when freed") {
  Fixture f;
  const Allocation a = f.alloc(4 * KiB), b = f.alloc(8 * KiB), c = f.alloc(16 * KiB);
  CHECK(at(b) == at(a) + 4 * KiB);
  CHECK(at(c) == at(b) + 8 * KiB);
  CHECK(f.stats().largest_free_block == 2 * MiB - 28 * KiB);  // the segment's tail

  f.free(c);  // merges with the tail
  CHECK(f.stats().largest_free_block == 2 * MiB - 12 * KiB);
  f.free(a);  // alone: b is still allocated
  const nlohmann::json split = nlohmann::json::parse(f.allocator->snapshot_json());
  REQUIRE(split["segments"].size() == 1);
  CHECK(split["segments"][0]["blocks"].size() == 3);  // a (free), b, c + tail (free)

  f.free(b);  // a + b + (c + tail): the whole segment again
  CHECK(f.stats().largest_free_block == 2 * MiB);
  const nlohmann::json merged = nlohmann::json::parse(f.allocator->snapshot_json());
  REQUIRE(merged["segments"][0]["blocks"].size() == 1);
  CHECK(merged["segments"][0]["blocks"][0]["state"] == "free");
  CHECK(merged["segments"][0]["blocks"][0]["size"] == 2 * MiB);
  const Allocation low = f.alloc(1 * MiB), high = f.alloc(1 * MiB);  // only fit because everything merged
  CHECK(at(low) == at(a));
  CHECK(at(high) == at(a) + 1 * MiB);
  CHECK(f.stats().segment_allocations == 1);
  f.free(low);
  f.free(high);
}

TEST_CASE("a block is reused only on the stream it was allocated on") {
  Fixture f;
  // Both ways round: the pool orders blocks by stream, so a lower and a higher stream id.
  f.device.stream = kOther;
  const Allocation other = f.alloc(64 * KiB);
  f.free(other);
  f.device.stream = kCompute;
  const Allocation a = f.alloc(64 * KiB);
  CHECK(at(a) != at(other));
  CHECK(f.stats().segment_allocations == 2);
  f.free(a);
  f.device.stream = kComm;
  const Allocation b = f.alloc(64 * KiB);
  CHECK(at(b) != at(a));
  CHECK(at(b) != at(other));
  CHECK(f.stats().segment_allocations == 3);
  f.device.stream = kCompute;
  const Allocation c = f.alloc(64 * KiB);
  CHECK(at(c) == at(a));
  f.free(b);
  f.free(c);
}

TEST_CASE("record_stream: a freed block waits until every other stream that used it is done") {
  Fixture f;
  const Allocation a = f.alloc(64 * KiB);
  f.allocator->record_stream(a.ptr, kComm);
  f.allocator->record_stream(a.ptr, kOther);
  f.allocator->record_stream(a.ptr, kComm);      // twice: one marker
  f.allocator->record_stream(a.ptr, kCompute);   // its own stream: ordered already, no marker
  f.free(a);
  CHECK(f.device.markers.size() == 2);
  CHECK(f.stats().allocated_total == 0);  // the owner's figures drop at once

  const Allocation b = f.alloc(64 * KiB);
  CHECK(at(b) != at(a));  // a is pending free
  f.device.finish(kComm);
  const Allocation c = f.alloc(64 * KiB);
  CHECK(at(c) != at(a));  // kOther may still use it
  f.device.finish(kOther);
  const Allocation d = f.alloc(64 * KiB);
  CHECK(at(d) == at(a));  // free now, and first in address order
  for (const Allocation& block : {b, c, d}) f.free(block);

  // Used only on its own stream: reused at once.
  const Allocation e = f.alloc(64 * KiB);
  f.allocator->record_stream(e.ptr, kCompute);
  f.free(e);
  const Allocation again = f.alloc(64 * KiB);
  CHECK(at(again) == at(e));
  f.free(again);
}

TEST_CASE("reuse before growth: the host waits for a pending free that can serve the request") {
  Fixture f;
  const Allocation a = f.alloc(1 * MiB), b = f.alloc(1 * MiB);  // one full small segment
  f.allocator->record_stream(a.ptr, kComm);
  f.free(a);  // pending: a collective on kComm may still read it
  const Allocation c = f.alloc(1 * MiB);
  CHECK(at(c) == at(a));  // waited for, not a new segment
  CHECK(f.device.waits == 1);
  CHECK(f.stats().segment_allocations == 1);
  // A pending free of the other pool cannot serve a small request: no wait, a new segment.
  const Allocation big = f.alloc(4 * MiB);
  f.allocator->record_stream(big.ptr, kComm);
  f.free(big);
  const Allocation d = f.alloc(1 * MiB);
  CHECK(f.device.waits == 1);
  CHECK(f.stats().segment_allocations == 3);
  for (const Allocation& block : {b, c, d}) f.free(block);
}

TEST_CASE("out of memory, the host waits for pending frees that merge into a fit before it gives up") {
  Fixture f;
  f.device.capacity = 20 * MiB;  // one large segment: a 5, b 5, c 10 MiB
  const Allocation a = f.alloc(5 * MiB), b = f.alloc(5 * MiB), c = f.alloc(10 * MiB);
  CHECK(f.stats().segment_allocations == 1);
  f.free(a);
  f.allocator->record_stream(b.ptr, kComm);
  f.free(b);  // pending, between two free blocks
  f.free(c);
  const Allocation whole = f.alloc(18 * MiB);  // only a + b + c, once b is free and merged
  CHECK(at(whole) == at(a));
  CHECK(f.device.waits == 1);
  CHECK(f.stats().retries == 0);  // nothing was given back
  CHECK(f.stats().segment_frees == 0);
  f.free(whole);
}

TEST_CASE("record_stream on a tensor, and its errors") {
  Fixture f;
  char* first = nullptr;
  {
    const Tensor t = tensor_over(f.allocator, 1024);
    first = static_cast<char*>(t.data_ptr());
    cuda::record_stream(t, kComm);
  }  // freed: pending until kComm is done
  const Allocation other = f.alloc(4 * KiB);
  CHECK(at(other) != first);
  f.device.finish(kComm);
  const Allocation reused = f.alloc(4 * KiB);
  CHECK(at(reused) == first);
  f.free(other);
  f.free(reused);

  CHECK_THROWS_WITH_AS(cuda::record_stream(Tensor(), kComm), doctest::Contains("undefined"), Error);
  CHECK_THROWS_WITH_AS(cuda::record_stream(zeros({4}), kComm), doctest::Contains("does not come from a caching allocator"),
                       Error);
  const Tensor released = tensor_over(f.allocator, 16);
  released.storage()->release();
  CHECK_THROWS_WITH_AS(cuda::record_stream(released, kComm), doctest::Contains("was released"), Error);
  int not_ours = 0;
  CHECK_THROWS_WITH_AS(f.allocator->record_stream(&not_ours, kComm), doctest::Contains("is not an allocated block"),
                       Error);
}

TEST_CASE("empty_cache gives back whole free segments only") {
  Fixture f;
  const Allocation kept = f.alloc(1000);         // small segment, in use
  const Allocation mid = f.alloc(3 * MiB);       // a 20 MiB segment (17 MiB of it left free)
  const Allocation big = f.alloc(24 * MiB);      // its own 24 MiB segment
  const Allocation pending = f.alloc(32 * MiB);  // its own 32 MiB segment, used on kComm
  f.allocator->record_stream(pending.ptr, kComm);
  for (const Allocation& block : {mid, big, pending}) f.free(block);
  CHECK(f.stats().reserved == (2 + 20 + 24 + 32) * MiB);

  f.allocator->empty_cache();
  CHECK(f.stats().reserved == (2 + 32) * MiB);  // the pending block's segment stays
  CHECK(f.stats().segment_frees == 2);
  CHECK(f.device.segments.size() == 2);
  std::memset(kept.ptr, 0xab, 1000);  // still ours

  f.device.finish(kComm);
  f.allocator->empty_cache();
  CHECK(f.stats().reserved == 2 * MiB);
  CHECK(f.device.in_use == 2 * MiB);
  f.free(kept);
  f.allocator->empty_cache();
  CHECK(f.stats().reserved == 0);
  CHECK(f.device.segments.empty());
}

TEST_CASE("the cap bounds reserved bytes; the out-of-memory message gives the figures") {
  Fixture f;
  f.allocator->set_cap(4 * MiB);
  const Allocation p = f.alloc(1000 * KiB, MemoryCategory::parameter);
  const Allocation a = f.alloc(700 * KiB + 1, MemoryCategory::activation);
  CHECK(f.stats().reserved == 2 * MiB);
  const int64_t free_rest = 2 * MiB - 1000 * KiB - CachingAllocator::round_size(700 * KiB + 1);

  std::string message;
  try {
    f.alloc(3 * MiB, MemoryCategory::workspace);  // would take a 20 MiB segment
  } catch (const OutOfMemory& e) {
    message = e.what();
  }
  INFO(message);
  CHECK(message.find("out of memory on cuda:0 (over the memory cap)") != std::string::npos);
  CHECK(message.find("tried to allocate 3.00 MiB for workspace") != std::string::npos);
  CHECK(message.find("reserved 2.00 MiB of a cap of 4.00 MiB") != std::string::npos);
  CHECK(message.find("allocated " + format_bytes(1000 * KiB + 700 * KiB + 1)) != std::string::npos);
  CHECK(message.find("largest free block " + format_bytes(free_rest)) != std::string::npos);
  CHECK(message.find("parameter " + format_bytes(1000 * KiB) + " (" + format_bytes(1000 * KiB) + ")") !=
        std::string::npos);
  CHECK(message.find("activation " + format_bytes(700 * KiB + 1) + " (" +
                     format_bytes(CachingAllocator::round_size(700 * KiB + 1)) + ")") != std::string::npos);
  CHECK(f.stats().retries == 1);
  CHECK(f.stats().allocated_total == 1000 * KiB + 700 * KiB + 1);  // the failure left nothing behind

  const Allocation b = f.alloc(1 * MiB);  // a second 2 MiB segment fits under the cap
  const Allocation b2 = f.alloc(1 * MiB);  // and fills it
  CHECK(f.stats().reserved == 4 * MiB);
  CHECK_THROWS_AS(f.alloc(1 * MiB), OutOfMemory);  // a third segment does not fit
  CHECK(f.stats().retries == 2);
  f.allocator->set_cap(0);
  const Allocation c = f.alloc(1 * MiB);
  CHECK(f.stats().reserved == 6 * MiB);
  for (const Allocation& block : {p, a, b, b2, c}) f.free(block);
}

TEST_CASE("when the device is full, cached segments are given back and the request retried") {
  Fixture f;
  f.device.capacity = 24 * MiB;
  const Allocation first = f.alloc(12 * MiB);
  f.free(first);  // cached: 12 MiB reserved, nothing allocated
  const Allocation second = f.alloc(16 * MiB);  // 12 + 16 > 24: the cache goes back first
  CHECK(f.stats().retries == 1);
  CHECK(f.stats().segment_frees == 1);
  CHECK(f.stats().reserved == 16 * MiB);
  CHECK_THROWS_WITH_AS(f.alloc(16 * MiB), doctest::Contains("(the device is full)"), OutOfMemory);
  CHECK(f.stats().retries == 2);
  f.free(second);
}

TEST_CASE("per-category allocated and reserved bytes are exact, with peaks") {
  Fixture f;
  const std::vector<std::pair<int64_t, MemoryCategory>> requests = {
      {4000, MemoryCategory::parameter},     {1, MemoryCategory::parameter},
      {3 * MiB + 7, MemoryCategory::gradient}, {513, MemoryCategory::optimizer_state},
      {12 * MiB, MemoryCategory::activation}, {100, MemoryCategory::communication}};
  std::vector<Allocation> blocks;
  std::array<int64_t, kMemoryCategories> allocated{}, reserved{};
  for (const auto& [bytes, category] : requests) {
    blocks.push_back(f.alloc(bytes, category));
    allocated[static_cast<int>(category)] += bytes;
    reserved[static_cast<int>(category)] += CachingAllocator::round_size(bytes);
  }
  const MemoryStats s = f.stats();
  CHECK(s.allocated == allocated);
  CHECK(s.reserved_by == reserved);
  CHECK(s.reserved_of(MemoryCategory::parameter) == 4096 + 512);
  CHECK(s.allocated_total == 4000 + 1 + 3 * MiB + 7 + 513 + 12 * MiB + 100);
  CHECK(s.reserved == 2 * MiB + 20 * MiB);  // the 12 MiB fit in the 20 MiB segment's rest

  f.free(blocks[2]);  // the gradient
  const MemoryStats after = f.stats();
  CHECK(after[MemoryCategory::gradient] == 0);
  CHECK(after.reserved_of(MemoryCategory::gradient) == 0);
  CHECK(after.peak_of(MemoryCategory::gradient) == 3 * MiB + 7);
  CHECK(after.peak_reserved_by[static_cast<int>(MemoryCategory::gradient)] == 3 * MiB + 512);
  CHECK(after.reserved == s.reserved);  // cached, not given back
  for (size_t i = 0; i < blocks.size(); ++i)
    if (i != 2) f.free(blocks[i]);
  CHECK(f.stats().reserved_by == std::array<int64_t, kMemoryCategories>{});
}

TEST_CASE("reserved bytes stop growing over 100 identical steps") {
  Fixture f;
  const Allocation weights = f.alloc(6 * MiB, MemoryCategory::parameter);
  std::vector<int64_t> reserved, segments;
  for (int step = 0; step < 100; ++step) {
    std::vector<Allocation> activations;
    for (const int64_t bytes : {int64_t{300} * KiB, 2 * MiB + 100, int64_t{7000}, 11 * MiB, int64_t{64} * KiB})
      activations.push_back(f.alloc(bytes, MemoryCategory::activation));
    const Allocation workspace = f.alloc(5 * MiB, MemoryCategory::workspace);
    const Allocation bucket = f.alloc(3 * MiB, MemoryCategory::communication);
    f.allocator->record_stream(bucket.ptr, kComm);  // an all-reduce reads it
    f.free(workspace);
    const Allocation grads = f.alloc(6 * MiB, MemoryCategory::gradient);
    while (!activations.empty()) {
      f.free(activations.back());
      activations.pop_back();
    }
    f.free(bucket);
    f.free(grads);
    f.device.finish(kComm);  // the collective ends with the step
    reserved.push_back(f.stats().reserved);
    segments.push_back(f.stats().segment_allocations);
  }
  CHECK(reserved[1] == reserved[99]);
  CHECK(segments[1] == segments[99]);
  CHECK(f.stats().peak_reserved == reserved[99]);
  CHECK(f.stats()[MemoryCategory::parameter] == 6 * MiB);
  CHECK(f.stats().allocated_total == 6 * MiB);
  f.free(weights);
}

TEST_CASE("fragmentation is 1 - allocated / reserved") {
  Fixture f;
  CHECK(f.stats().fragmentation() == 0.0);
  const Allocation a = f.alloc(1000);  // a 1024 B block in a 2 MiB segment
  CHECK(f.stats().fragmentation() == doctest::Approx(1.0 - 1000.0 / (2.0 * MiB)));
  const Allocation b = f.alloc(1 * MiB), c = f.alloc(1 * MiB - 1024);  // fill the segment
  CHECK(f.stats().fragmentation() == doctest::Approx(24.0 / (2.0 * MiB)).epsilon(1e-9));
  CHECK(f.stats().largest_free_block == 0);
  const std::string report = memory_report(f.stats(), "rank 0, cuda:0");
  CHECK(report.find("fragmentation 0.0%") != std::string::npos);
  CHECK(report.find("segments 1 taken") != std::string::npos);
  for (const Allocation& block : {a, b, c}) f.free(block);
  CHECK(f.stats().fragmentation() == doctest::Approx(1.0));
}

TEST_CASE("the snapshot is JSON with the events in order and the segments' layout") {
  Fixture f;
  const Allocation a = f.alloc(1000, MemoryCategory::parameter);
  f.allocator->record_stream(a.ptr, kComm);
  f.free(a);
  f.device.finish(kComm);
  const Allocation b = f.alloc(12 * MiB, MemoryCategory::activation);  // processes a's pending free first
  f.free(b);
  f.allocator->empty_cache();

  const nlohmann::json doc = nlohmann::json::parse(f.allocator->snapshot_json());
  CHECK(doc["device"] == "cuda:0");
  const auto& events = doc["events"];
  std::vector<std::string> actions;
  for (const auto& e : events) actions.push_back(e["action"]);
  CHECK(actions == std::vector<std::string>{"segment_alloc", "alloc", "pending_free", "free", "segment_alloc", "alloc",
                                            "free", "segment_free", "segment_free"});
  for (size_t i = 1; i < events.size(); ++i) CHECK(events[i]["time_us"] >= events[i - 1]["time_us"]);
  CHECK(events[1]["category"] == "parameter");
  CHECK(events[1]["requested"] == 1000);
  CHECK(events[1]["size"] == 1024);
  CHECK(events[1]["stream"] == 1);
  CHECK(events[1]["address"] == reinterpret_cast<std::uintptr_t>(a.ptr));
  CHECK(events[4]["size"] == 12 * MiB);
  CHECK(events[8]["category"].is_null());
  CHECK(doc["segments"].empty());
  CHECK(doc["stats"]["segment_allocations"] == 2);
  CHECK(doc["dropped_events"] == 0);

  const std::filesystem::path path = std::filesystem::temp_directory_path() / "zg_caching_allocator_snapshot.json";
  f.allocator->write_snapshot(path.string());
  std::ifstream in(path);
  CHECK(nlohmann::json::parse(in)["events"] == events);
  std::filesystem::remove(path);
  CHECK_THROWS_WITH_AS(f.allocator->write_snapshot("/nonexistent-dir/snapshot.json"), doctest::Contains("cannot open"),
                       Error);
}

TEST_CASE("the history keeps the latest events") {
  Fixture f(3);
  for (int i = 0; i < 3; ++i) f.free(f.alloc(100));
  const nlohmann::json doc = nlohmann::json::parse(f.allocator->snapshot_json());
  CHECK(doc["events"].size() == 3);
  CHECK(doc["dropped_events"] == 4);  // segment_alloc, then alloc/free three times
  CHECK(doc["events"][2]["action"] == "free");
}

TEST_CASE("bad input gives a clear error") {
  Fixture f;
  int not_ours = 0;
  CHECK_THROWS_WITH_AS(f.free(Allocation{&not_ours, 4, MemoryCategory::other}), doctest::Contains("deallocate"), Error);
  CHECK_THROWS_WITH_AS(f.alloc(-1), doctest::Contains("negative size"), Error);
  CHECK_THROWS_WITH_AS(f.alloc(int64_t{1} << 60), doctest::Contains("larger than any device"), OutOfMemory);
  CHECK(f.stats().allocated_total == 0);
  CHECK_THROWS_WITH_AS(cuda::caching_allocator(kCPU), doctest::Contains("does not cache"), Error);
  CHECK_THROWS_WITH_AS(CachingAllocator(kCUDA, nullptr), doctest::Contains("no memory source"), Error);
  const Allocation ok = f.alloc(0);  // nothing to allocate
  CHECK(ok.ptr == nullptr);
}

TEST_CASE("the allocator returns every segment to the device when it is destroyed") {
  FakeDevice device;
  {
    CachingAllocator allocator(kCUDA, std::make_unique<FakeSource>(device));
    const Allocation a = allocator.allocate(100, MemoryCategory::other);
    allocator.record_stream(a.ptr, kComm);
    allocator.deallocate(a);  // still pending free
    allocator.deallocate(allocator.allocate(12 * MiB, MemoryCategory::other));
    CHECK(device.segments.size() == 2);
  }
  CHECK(device.segments.empty());
}

TEST_CASE("two threads share one allocator safely") {
  Fixture f;
  auto work = [&f] {
    for (int i = 0; i < 200; ++i) {
      const Allocation a = f.alloc(1000 + 7 * i), b = f.alloc(2 * MiB + i);
      std::memset(a.ptr, i, static_cast<size_t>(a.bytes));
      f.free(b);
      f.free(a);
    }
  };
  std::thread t0(work), t1(work);
  t0.join();
  t1.join();
  CHECK(f.stats().allocated_total == 0);
  CHECK(f.stats().allocations == 800);
}

// The rule of the attention graph cache (cuda/attention.cu), which keeps at most 128
// cuDNN graphs per direction: building 129 graphs on a GPU is too slow for the suite.
TEST_CASE("LruCache keeps at most its capacity, the least recently used going first") {
  cuda::LruCache<int, std::string> cache(3);
  int made = 0;
  const auto get = [&](int key) { return cache.get_or_make(key, [&] { ++made; return std::to_string(key); }); };
  CHECK(get(1) == "1");
  CHECK(get(2) == "2");
  CHECK(get(3) == "3");
  CHECK(get(1) == "1");  // found: 1 is now the most recently used
  CHECK(made == 3);
  CHECK(get(4) == "4");  // full: 2, used longest ago, goes
  CHECK(cache.size() == 3);
  CHECK_FALSE(cache.contains(2));
  CHECK((cache.contains(1) && cache.contains(3) && cache.contains(4)));
  CHECK(get(2) == "2");  // made again; 3 goes
  CHECK(made == 5);
  CHECK_FALSE(cache.contains(3));
  // A make() that throws leaves the cache as it was: nothing evicted, nothing added.
  CHECK_THROWS_AS(cache.get_or_make(9, []() -> std::string { throw Error("cannot build"); }), Error);
  CHECK(cache.size() == 3);
  CHECK((cache.contains(1) && cache.contains(4) && cache.contains(2)));
}

TEST_CASE("a dry run through the caching allocator over a simulated device reserves as a GPU's cache would") {
  Context rank;
  rank.set_allocator(kMeta, cuda::simulated_caching_allocator(kMeta, 64 * MiB));
  CHECK_THROWS_WITH_AS(rank.set_allocator(kMeta, cuda::simulated_caching_allocator(kMeta)),
                       "Context::set_allocator: rank 0 already has an allocator for meta (install one before the "
                       "first tensor on that device)", Error);
  CHECK_THROWS_WITH_AS(rank.set_allocator(kCPU, cuda::simulated_caching_allocator(kMeta)),
                       "Context::set_allocator: the allocator given for cpu is for meta", Error);
  ContextGuard guard(rank);
  {
    const Tensor a = empty({3}, kMeta);                  // 12 bytes: a 512 B block of a 2 MiB segment
    const Tensor b = empty({3 * 1024 * 1024}, kMeta);    // 12 MiB: a segment of its own
    CHECK(memory_stats(kMeta).allocated_total == 12 + 12 * MiB);
    CHECK(memory_stats(kMeta).reserved == 2 * MiB + 12 * MiB);
    CHECK_THROWS_AS(empty({16 * 1024 * 1024}, kMeta), OutOfMemory);  // 64 MiB more than the device holds
  }
  const MemoryStats cached = memory_stats(kMeta);
  CHECK(cached.allocated_total == 0);
  CHECK(cached.reserved == 14 * MiB);  // the freed blocks stay cached for the next step
  const Tensor again = empty({3 * 1024 * 1024}, kMeta);
  CHECK(memory_stats(kMeta).segment_allocations == cached.segment_allocations);  // reused, not taken again
}

}  // namespace zg::test
