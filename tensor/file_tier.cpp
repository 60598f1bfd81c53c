#include "tensor/file_tier.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "tensor/backend.h"
#include "tensor/step_log.h"

namespace zg {

namespace {

constexpr int64_t kAlign = 4096;           // O_DIRECT's offsets, lengths and buffers
constexpr int64_t kChunk = int64_t{4} << 20;  // one pread / pwrite: several in flight keep the disk's queue full

int64_t align_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

// A tensor's read or write: its chunks run on the I/O threads; the last one done wakes the waiter.
struct FileRequest {
  bool write = false;
  int64_t chunks_left = 0;
  std::string error;  // the first chunk's that failed
  bool done() const { return chunks_left == 0; }
};

struct FileTier::Impl {
  struct Chunk {
    std::shared_ptr<FileRequest> request;
    char* bytes;
    int64_t size, offset;
    bool direct;
    std::string what;
  };

  std::string path;
  PagedTensor* behind = nullptr;  // page_out_behind's write in flight
  int direct_fd = -1, buffered_fd = -1;
  int64_t reserved = 0;
  mutable std::mutex mutex;
  std::condition_variable work_ready, chunk_done;
  std::deque<Chunk> queue;
  std::vector<std::thread> threads;
  bool stopping = false;
  FileTierStats stats;
  int in_flight[2] = {0, 0};   // requests of each kind (read, write) not yet done
  double busy_since[2] = {0, 0};

  // All `size` bytes at `offset`, or the reason they could not be moved.
  std::string transfer(const Chunk& c) const {
    const int fd = c.direct ? direct_fd : buffered_fd;
    const bool write = c.request->write;
    for (int64_t done = 0; done < c.size;) {
      const ssize_t n = write ? ::pwrite(fd, c.bytes + done, c.size - done, c.offset + done)
                              : ::pread(fd, c.bytes + done, c.size - done, c.offset + done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        return std::string(write ? "pwrite" : "pread") + " of " + std::to_string(c.size) + " bytes at offset " +
               std::to_string(c.offset + done) + " of " + path + " (" + c.what + ") failed: " +
               (n < 0 ? std::strerror(errno) : "end of file");
      done += n;
    }
    return "";
  }

  void run() {
    for (;;) {
      Chunk chunk;
      {
        std::unique_lock lock(mutex);
        work_ready.wait(lock, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) return;
        chunk = std::move(queue.front());
        queue.pop_front();
      }
      const std::string error = transfer(chunk);
      std::lock_guard lock(mutex);
      FileRequest& r = *chunk.request;
      if (!error.empty() && r.error.empty()) r.error = error;
      (r.write ? stats.bytes_written : stats.bytes_read) += error.empty() ? chunk.size : 0;
      if (--r.chunks_left == 0) {
        const int kind = r.write ? 1 : 0;
        if (--in_flight[kind] == 0) (r.write ? stats.write_seconds : stats.read_seconds) += now() - busy_since[kind];
        chunk_done.notify_all();
      }
    }
  }

  // Cuts [offset, offset + size) into chunks: O_DIRECT for the 4 KiB-aligned body where
  // the buffer allows, buffered for the tail (and for everything without O_DIRECT).
  std::shared_ptr<FileRequest> submit(bool write, char* bytes, int64_t size, int64_t offset,
                                               const std::string& what) {
    auto request = std::make_shared<FileRequest>();
    request->write = write;
    const bool aligned = direct_fd >= 0 && reinterpret_cast<uintptr_t>(bytes) % kAlign == 0;
    const int64_t body = aligned ? size / kAlign * kAlign : 0;
    std::vector<Chunk> chunks;
    for (int64_t at = 0; at < size;) {
      const bool direct = at < body;
      const int64_t n = std::min(kChunk, (direct ? body : size) - at);
      chunks.push_back({request, bytes + at, n, offset + at, direct, what});
      at += n;
    }
    std::lock_guard lock(mutex);
    request->chunks_left = static_cast<int64_t>(chunks.size());
    if (chunks.empty()) return request;
    const int kind = write ? 1 : 0;
    if (in_flight[kind]++ == 0) busy_since[kind] = now();
    for (Chunk& c : chunks) queue.push_back(std::move(c));
    work_ready.notify_all();
    return request;
  }

  void wait(const FileRequest& request) {
    std::unique_lock lock(mutex);
    chunk_done.wait(lock, [&] { return request.done(); });
  }
};

FileTier::FileTier(const std::string& folder, const std::string& owner, Device host, int threads)
    : folder_(folder), host_(host), impl_(std::make_unique<Impl>()) {
  ZG_CHECK(host.type == DeviceType::cpu || host.type == DeviceType::meta,
           "FileTier: the host side of a file tier is cpu (or meta for a dry run), not ", host.str());
  ZG_CHECK(threads >= 1, "FileTier: needs at least one I/O thread, got ", threads);
  if (host.type == DeviceType::meta) return;
  ZG_CHECK(!folder.empty(), "FileTier: no folder given for the file tier; name one on a fast local disk (--offload-dir)");
  std::error_code ec;
  ZG_CHECK(std::filesystem::is_directory(folder, ec), "FileTier: '", folder,
           "' is not a folder; create it first (the file tier writes its file there)");
  static std::atomic<int> made{0};
  impl_->path = folder + "/zerograd-" + owner + "-" + std::to_string(::getpid()) + "-" + std::to_string(made++) + ".tier";
  impl_->buffered_fd = ::open(impl_->path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  ZG_CHECK(impl_->buffered_fd >= 0, "FileTier: cannot create ", impl_->path, ": ", std::strerror(errno));
  impl_->direct_fd = ::open(impl_->path.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);  // -1 where unsupported (tmpfs)
  ::unlink(impl_->path.c_str());  // the bytes live while the descriptors do
  impl_->stats.direct = impl_->direct_fd >= 0;
  for (int i = 0; i < threads; ++i) impl_->threads.emplace_back([impl = impl_.get()] { impl->run(); });
}

FileTier::~FileTier() {
  {
    std::lock_guard lock(impl_->mutex);
    impl_->stopping = true;
    impl_->work_ready.notify_all();
  }
  for (std::thread& t : impl_->threads) t.join();  // the queue drains first
  for (int fd : {impl_->direct_fd, impl_->buffered_fd})
    if (fd >= 0) ::close(fd);
}

FileTierStats FileTier::stats() const {
  std::lock_guard lock(impl_->mutex);
  FileTierStats s = impl_->stats;
  s.file_bytes = impl_->reserved;
  return s;
}

PagedTensor::PagedTensor(std::shared_ptr<FileTier> tier, Tensor tensor, std::string what)
    : tier_(std::move(tier)), tensor_(std::move(tensor)), what_(std::move(what)), state_(State::in) {
  ZG_CHECK(tensor_.device() == tier_->host(), "PagedTensor: ", what_, " is on ", tensor_.device().str(),
           "; the file tier pages ", tier_->host().str(), " tensors");
  ZG_CHECK(tensor_.is_contiguous() && tensor_.offset() == 0 &&
               tensor_.numel() * element_size(tensor_.dtype()) == tensor_.storage()->nbytes(),
           "PagedTensor: ", what_, " must own its whole storage (a view cannot be paged alone)");
  FileTier::Impl& impl = *tier_->impl_;
  std::lock_guard lock(impl.mutex);
  offset_ = impl.reserved;
  impl.stats.paged_bytes += tensor_.storage()->nbytes();
  const int64_t end = offset_ + align_up(tensor_.storage()->nbytes());
  if (impl.buffered_fd >= 0) {
    // Reserve the disk space now, so a full disk is refused here, not in a write mid-step.
    const int err = ::posix_fallocate(impl.buffered_fd, offset_, end - offset_);
    if (err == EOPNOTSUPP || err == EINVAL) {
      ZG_CHECK(::ftruncate(impl.buffered_fd, end) == 0, "FileTier: cannot grow ", impl.path, " to ", end,
               " bytes: ", std::strerror(errno));
    } else {
      ZG_CHECK(err == 0, "FileTier: no room in ", tier_->folder(), " for ", what_, " (", end - offset_,
               " bytes at offset ", offset_, "): ", std::strerror(err),
               "; free space there or give the file tier another folder");
    }
  }
  impl.reserved = end;
  tensor_.storage()->set_release_note(what_ + " lives in the file tier (" + tier_->folder() +
                                      ") and is in host memory only while paged in");
}

PagedTensor::~PagedTensor() {
  if (tier_->impl_->behind == this) tier_->impl_->behind = nullptr;
  if (request_) tier_->impl_->wait(*request_);
}

void PagedTensor::page_in() {
  if (state_ == State::in || state_ == State::reading) return;
  const bool io = tier_->host().type == DeviceType::cpu;
  if (state_ == State::writing) {  // its bytes are still here: let the write finish, keep them
    tier_->impl_->wait(*request_);
    finish_write();
  } else {
    tensor_.storage()->materialize();
    if (!zeros_ && !io) note_disk();  // a dry run's read, for the step-time model
    if (!zeros_ && io) {
      request_ = tier_->impl_->submit(false, static_cast<char*>(tensor_.storage()->data()),
                                      tensor_.storage()->nbytes(), offset_, what_);
      state_ = State::reading;
      return;
    }
  }
  state_ = State::in;
  if (zeros_ && io) backend(tensor_.device()).fill(tensor_, 0.0);  // through the backend: no version bump
}

void PagedTensor::wait() {
  if (state_ != State::reading) return;
  FileTier::Impl& impl = *tier_->impl_;
  {
    std::lock_guard lock(impl.mutex);
    impl.stats.waits += request_->done() ? 0 : 1;
  }
  impl.wait(*request_);
  const std::string error = std::exchange(request_, nullptr)->error;
  state_ = State::in;
  if (!error.empty()) {
    tensor_.storage()->release();
    state_ = State::out;
    fail("FileTier: ", error);
  }
}

void PagedTensor::page_out(bool changed) {
  wait();
  if (state_ != State::in) return;
  if (changed) zeros_ = false;
  // Unchanged values the file already holds (or zeros) need no write.
  const bool write = changed || (!on_file_ && !zeros_);
  if (!write || tier_->host().type != DeviceType::cpu) {
    if (write) note_disk(), on_file_ = true;  // a dry run's write
    tensor_.storage()->release();
    state_ = State::out;
    return;
  }
  request_ = tier_->impl_->submit(true, static_cast<char*>(tensor_.storage()->data()), tensor_.storage()->nbytes(),
                                  offset_, what_);
  state_ = State::writing;
}

void PagedTensor::page_out_behind() {
  page_out(true);
  PagedTensor* previous = std::exchange(tier_->impl_->behind, this);
  if (previous && previous != this) previous->settle(true);
}

void PagedTensor::note_disk() const {
  if (StepLog* log = StepLog::current()) log->offload(StepEvent::Kind::disk, static_cast<double>(tensor_.nbytes()));
}

// The write is done: its error, if any, is thrown (the values stay in memory, in).
void PagedTensor::finish_write() {
  const std::string error = std::exchange(request_, nullptr)->error;
  state_ = State::in;
  ZG_CHECK(error.empty(), "FileTier: ", error, "; the values stay in host memory");
  on_file_ = true;
}

void PagedTensor::settle(bool block) {
  if (state_ != State::writing) return;
  FileTier::Impl& impl = *tier_->impl_;
  if (!block) {
    std::lock_guard lock(impl.mutex);
    if (!request_->done()) return;
  }
  impl.wait(*request_);
  finish_write();
  tensor_.storage()->release();
  state_ = State::out;
}

void PagedTensor::mark_zero() {
  zeros_ = true;
  on_file_ = false;  // the file's values are stale now
  settle(true);      // a write in flight: done, and out
  wait();            // a read in flight: in
  if (state_ == State::in && tier_->host().type == DeviceType::cpu) backend(tensor_.device()).fill(tensor_, 0.0);
}

}  // namespace zg
