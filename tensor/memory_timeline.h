// A memory timeline: every allocation and free of every allocator -- each device, each
// rank, the host pools -- while a recording lives, with its time, category, bytes and
// the step phase it happened in. The phase is the path of profiler ranges (trace.h)
// open on the allocating thread (a model called through Module::operator() adds its own
// range first; GPT::forward called directly does not):
//   forward    "h.1 (Block) > attn (CausalSelfAttention) > c_attn (Linear)"
//   backward   "backward > h.1 (Block) > mlp (MLP) > c_fc (Linear) > linear"
//              (an autograd node keeps the path it was recorded under: unit k's
//              backward is named after its forward)
//   dist       "gather transformer.h.3", "reduce_gradients transformer.h.1",
//              "optimizer > adamw", "after_step transformer.h.0", under whatever was
//              open when the unit's scheduler called them
// Off, it costs one atomic load per allocation and per range. On, it keeps at most
// `capacity` events; the rest are counted as dropped and every export says so. Every
// range kept is closed: a range still open when the recording ends (another thread's, in
// a collective that let the recording's owner go on) ends at the recording's end, and a
// range is kept only while there is room for its end.
//
// A recording begins with what every allocator holds (one `allocate` per category, a
// `reserve` of its reserved bytes), so the running sums of a timeline are the
// allocators' own figures: an allocator's peak_total after reset_peaks() is the largest
// sum the timeline reaches for it.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "tensor/device.h"
#include "tensor/memory.h"

namespace zg {

struct TimelineEvent {
  enum class Kind : uint8_t {
    allocate,  // `bytes` handed out for `category`
    free,      // `bytes` of `category` given back
    reserve,   // the allocator's reserved bytes changed by `bytes` (segments; caching)
    begin,     // a range opened on `thread`: `path` is its own
    end,       // the innermost range open on `thread` closed (`rank` is its begin's)
  };
  Kind kind = Kind::allocate;
  MemoryCategory category = MemoryCategory::other;
  bool host_pool = false;  // the rank's host pool (offload, pinned memory), not its device allocator
  Device device;           // the allocator's (allocate, free, reserve)
  int rank = 0;            // the allocator's, or (ranges) the thread's current context's
  int thread = 0;          // a small number per thread, in order of first use
  int64_t bytes = 0;
  int64_t time_ns = 0;     // since the recording began (steady clock)
  int32_t path = -1;       // allocate, free: the innermost range open on the thread (-1: none)
};

class MemoryTimeline {
 public:
  static constexpr size_t kDefaultCapacity = size_t{1} << 20;  // events (about 48 MiB)
  explicit MemoryTimeline(size_t capacity = kDefaultCapacity);
  MemoryTimeline(const MemoryTimeline&) = delete;
  MemoryTimeline& operator=(const MemoryTimeline&) = delete;

  // In the order they happened. Read them once the recording has ended.
  const std::vector<TimelineEvent>& events() const { return events_; }
  const std::string& path(int32_t id) const;  // "" for -1
  int64_t dropped() const { return dropped_; }  // events past the capacity, not kept
  // The name a thread gave its row (set_trace_thread_name: "communication"); "" if none.
  const std::string& thread_name(int thread) const;
  size_t capacity() const { return capacity_; }
  // True when memory events are on the meta device: a dry run, whose times are not the
  // device's (figures then use the event's index as its time).
  bool dry_run() const;

 private:
  friend class MemoryTimelineRecording;
  friend struct TimelineHooks;
  // A range open on a thread: its path, its begin's rank, and whether its begin was kept.
  struct OpenRange {
    int32_t path;
    int rank;
    bool kept;
  };
  // With mutex_ held.
  int32_t intern(const std::string& path);
  bool push(TimelineEvent event, size_t room = 1);  // stamps the time; kept if `room` events fit
  void close(int thread, const OpenRange& range);   // its end event, if its begin was kept

  size_t capacity_;
  std::mutex mutex_;
  std::vector<TimelineEvent> events_;
  std::vector<std::string> paths_;
  std::map<std::string, int32_t> path_ids_;
  std::map<int, std::vector<OpenRange>> open_;  // by thread, innermost last
  size_t closing_ = 0;                          // open ranges kept: room held for their ends
  std::map<int, std::string> thread_names_;
  int64_t dropped_ = 0;
  int64_t start_ns_ = 0;
  std::atomic<uint64_t> generation_{0};  // this recording's number (0: never recorded)
};

// Records into `timeline` while it lives. One recording at a time in a process: every
// rank's allocators (ranks may be threads) go into the same timeline, told apart by rank.
class MemoryTimelineRecording {
 public:
  explicit MemoryTimelineRecording(MemoryTimeline& timeline);
  // Waits for events being noted on other threads, then ends the ranges still open.
  ~MemoryTimelineRecording();
  MemoryTimelineRecording(const MemoryTimelineRecording&) = delete;
  MemoryTimelineRecording& operator=(const MemoryTimelineRecording&) = delete;

 private:
  // Starts it; the public one then notes what is held (constructed by then, a throw there
  // still ends the recording).
  MemoryTimelineRecording(MemoryTimeline& timeline, int);
  MemoryTimeline& timeline_;
};

// A range path as the recording saw it, kept where a range is opened later on another
// path (an autograd node: its backward runs under the path its forward had).
struct TracePath {
  uint64_t generation = 0;  // of the recording (0: none)
  int32_t id = -1;
};

// What the allocator and the trace ranges call (not for users). Each returns at once
// after one atomic load when nothing records.
struct TimelineHooks {
  struct Owner {  // an allocator's
    Device device;
    int rank;
    bool host_pool;
    uint64_t* generation;  // the recording the allocator last noted into (its baseline's)
    const MemoryStats* stats;  // its figures before this event (for the baseline)
  };
  static void memory(const Owner& owner, TimelineEvent::Kind kind, MemoryCategory category, int64_t bytes);
  static void held(const Owner& owner);  // its figures now, unless already noted in this recording
  // Returns the recording's generation when the range was noted (0: none).
  static uint64_t begin_range(const char* name, TracePath scope);
  static void end_range(uint64_t generation);
  static TracePath current_path();
  static void name_thread(const std::string& name);  // set_trace_thread_name's (trace.h)

 private:
  static void note_held(MemoryTimeline& t, const Owner& owner);
  static int thread_of(MemoryTimeline& t);  // this thread's number, its name noted in t
};
// The innermost range open on this thread, when recording.
inline TracePath current_trace_path() { return TimelineHooks::current_path(); }

}  // namespace zg
