#include "tensor/memory_timeline.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "tensor/context.h"
#include "tensor/error.h"

namespace zg {

namespace {

// The recording in progress. A note loads it once (off: nothing more); on, it counts
// itself in `noting` and loads it again, so a recording that ends waits for notes that
// saw it before it hands the timeline back to its owner.
std::atomic<MemoryTimeline*> active{nullptr};
std::atomic<int> noting{0};
std::atomic<uint64_t> generations{0};

struct Noting {
  MemoryTimeline* timeline;
  Noting() {
    noting.fetch_add(1);
    timeline = active.load();
  }
  ~Noting() { noting.fetch_sub(1); }
};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int thread_number() {
  static std::atomic<int> threads{0};
  thread_local const int mine = threads.fetch_add(1);
  return mine;
}

// The name this thread gave itself, and the recording it last noted it in.
struct ThreadName {
  std::string name;
  uint64_t noted_in = 0;
};
thread_local ThreadName own_name;

}  // namespace

MemoryTimeline::MemoryTimeline(size_t capacity) : capacity_(capacity) {
  ZG_CHECK(capacity > 0, "MemoryTimeline: capacity must be at least one event");
}

const std::string& MemoryTimeline::path(int32_t id) const {
  static const std::string none;
  ZG_CHECK(id >= -1 && id < static_cast<int32_t>(paths_.size()), "MemoryTimeline: no path numbered ", id, " (",
           paths_.size(), " recorded)");
  return id < 0 ? none : paths_[static_cast<size_t>(id)];
}

const std::string& MemoryTimeline::thread_name(int thread) const {
  static const std::string none;
  const auto at = thread_names_.find(thread);
  return at == thread_names_.end() ? none : at->second;
}

bool MemoryTimeline::dry_run() const {
  for (const TimelineEvent& e : events_)
    if (e.kind != TimelineEvent::Kind::begin && e.kind != TimelineEvent::Kind::end && e.device.type == DeviceType::meta)
      return true;
  return false;
}

int32_t MemoryTimeline::intern(const std::string& path) {
  const auto [at, added] = path_ids_.try_emplace(path, static_cast<int32_t>(paths_.size()));
  if (added) paths_.push_back(path);
  return at->second;
}

// Room is held for the end of every range kept (closing_), so that no begin is left
// without its end when the capacity runs out.
bool MemoryTimeline::push(TimelineEvent event, size_t room) {
  if (event.kind != TimelineEvent::Kind::end && events_.size() + closing_ + room > capacity_) {
    ++dropped_;
    return false;
  }
  event.time_ns = now_ns() - start_ns_;
  events_.push_back(event);
  return true;
}

void MemoryTimeline::close(int thread, const OpenRange& range) {
  if (!range.kept) {
    ++dropped_;
    return;
  }
  --closing_;
  push({.kind = TimelineEvent::Kind::end, .device = Device(), .rank = range.rank, .thread = thread,
        .path = range.path});
}

MemoryTimelineRecording::MemoryTimelineRecording(MemoryTimeline& timeline, int) : timeline_(timeline) {
  // Notes that see the timeline wait on its lock until it is reset.
  std::lock_guard lock(timeline.mutex_);
  MemoryTimeline* none = nullptr;
  ZG_CHECK(active.compare_exchange_strong(none, &timeline),
           "MemoryTimelineRecording: another recording is in progress; end it first (one at a time)");
  timeline.events_.clear();
  timeline.paths_.clear();
  timeline.path_ids_.clear();
  timeline.open_.clear();
  timeline.closing_ = 0;
  timeline.thread_names_.clear();
  timeline.dropped_ = 0;
  timeline.start_ns_ = now_ns();
  timeline.generation_.store(generations.fetch_add(1) + 1);
}

MemoryTimelineRecording::MemoryTimelineRecording(MemoryTimeline& timeline) : MemoryTimelineRecording(timeline, 0) {
  // What every rank's allocators hold as the recording begins, so that one that allocates
  // nothing while it records (a host pool holding Adam state) is drawn all the same; and
  // this thread's own (a one-rank program's). Other threads' own contexts are noted when
  // they first allocate.
  for (const auto& allocator : Context::rank_allocators()) allocator->note_held();
  for (const auto& allocator : Context::current().allocators()) allocator->note_held();
}

MemoryTimelineRecording::~MemoryTimelineRecording() {
  active.store(nullptr);
  while (noting.load() != 0) std::this_thread::yield();
  // What other threads still have open (a rank's thread that has not yet left the
  // collective whose end let this one go on) ends here: their own ends come too late.
  std::lock_guard lock(timeline_.mutex_);
  for (auto& [thread, open] : timeline_.open_)
    for (; !open.empty(); open.pop_back()) timeline_.close(thread, open.back());
}

int TimelineHooks::thread_of(MemoryTimeline& t) {
  const int thread = thread_number();
  if (own_name.noted_in != t.generation_) {
    own_name.noted_in = t.generation_;
    if (!own_name.name.empty()) t.thread_names_[thread] = own_name.name;
  }
  return thread;
}

void TimelineHooks::name_thread(const std::string& name) {
  own_name = {name, 0};
  if (active.load(std::memory_order_relaxed) == nullptr) return;
  const Noting note;
  if (MemoryTimeline* t = note.timeline) {
    std::lock_guard lock(t->mutex_);
    thread_of(*t);
  }
}

TracePath TimelineHooks::current_path() {
  if (active.load(std::memory_order_relaxed) == nullptr) return {};
  const Noting note;
  MemoryTimeline* t = note.timeline;
  if (!t) return {};
  std::lock_guard lock(t->mutex_);
  const std::vector<MemoryTimeline::OpenRange>& open = t->open_[thread_of(*t)];
  return open.empty() ? TracePath{} : TracePath{t->generation_, open.back().path};
}

// With t's lock held: the allocator's figures before its first event of this recording,
// as events, once.
void TimelineHooks::note_held(MemoryTimeline& t, const Owner& owner) {
  if (*owner.generation == t.generation_) return;
  *owner.generation = t.generation_;
  TimelineEvent e{.kind = TimelineEvent::Kind::allocate, .host_pool = owner.host_pool, .device = owner.device,
                  .rank = owner.rank, .thread = thread_of(t)};
  for (int c = 0; c < kMemoryCategories; ++c)
    if (owner.stats->allocated[c] != 0) {
      e.category = static_cast<MemoryCategory>(c), e.bytes = owner.stats->allocated[c];
      t.push(e);
    }
  if (owner.stats->reserved != 0) {
    e.kind = TimelineEvent::Kind::reserve, e.category = MemoryCategory::other, e.bytes = owner.stats->reserved;
    t.push(e);
  }
}

void TimelineHooks::held(const Owner& owner) {
  if (active.load(std::memory_order_relaxed) == nullptr) return;
  const Noting note;
  if (MemoryTimeline* t = note.timeline) {
    std::lock_guard lock(t->mutex_);
    note_held(*t, owner);
  }
}

void TimelineHooks::memory(const Owner& owner, TimelineEvent::Kind kind, MemoryCategory category, int64_t bytes) {
  if (active.load(std::memory_order_relaxed) == nullptr) return;
  const Noting note;
  MemoryTimeline* t = note.timeline;
  if (!t) return;
  std::lock_guard lock(t->mutex_);
  note_held(*t, owner);
  const int thread = thread_of(*t);
  const std::vector<MemoryTimeline::OpenRange>& open = t->open_[thread];
  t->push({.kind = kind, .category = category, .host_pool = owner.host_pool, .device = owner.device,
           .rank = owner.rank, .thread = thread, .bytes = bytes, .path = open.empty() ? -1 : open.back().path});
}

uint64_t TimelineHooks::begin_range(const char* name, TracePath scope) {
  if (active.load(std::memory_order_relaxed) == nullptr) return 0;
  const Noting note;
  MemoryTimeline* t = note.timeline;
  if (!t) return 0;
  std::lock_guard lock(t->mutex_);
  const int thread = thread_of(*t);
  std::vector<MemoryTimeline::OpenRange>& open = t->open_[thread];
  // The parent's path, then (an autograd node's backward) the path its forward ran under.
  std::string path = open.empty() ? "" : t->paths_[static_cast<size_t>(open.back().path)] + " > ";
  if (scope.generation == t->generation_ && scope.id >= 0) path += t->paths_[static_cast<size_t>(scope.id)] + " > ";
  path += name;
  const int32_t id = t->intern(path);
  const int rank = Context::current().rank();
  // Kept only with room for its end as well.
  const bool kept = t->push({.kind = TimelineEvent::Kind::begin, .device = Device(), .rank = rank, .thread = thread,
                             .path = id}, 2);
  if (kept) ++t->closing_;
  open.push_back({id, rank, kept});
  return t->generation_;
}

void TimelineHooks::end_range(uint64_t generation) {
  if (generation == 0 || active.load(std::memory_order_relaxed) == nullptr) return;
  const Noting note;
  MemoryTimeline* t = note.timeline;
  if (!t || t->generation_ != generation) return;  // opened in a recording that has ended
  std::lock_guard lock(t->mutex_);
  const int thread = thread_of(*t);
  std::vector<MemoryTimeline::OpenRange>& open = t->open_[thread];
  if (open.empty()) return;
  t->close(thread, open.back());
  open.pop_back();
}

}  // namespace zg
