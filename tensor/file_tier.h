// The file tier (ZeRO-Infinity's NVMe): host tensors whose bytes live in a file between
// uses, so the state they hold can outgrow host memory. One file per tier, in a folder
// the user gives, unlinked as soon as it is open (a crash leaves nothing behind; resuming
// goes through checkpoints); each tensor a region at a 4 KiB-aligned offset. Reads and
// writes run on the tier's I/O threads, in chunks, straight between the file and the host
// pool's buffers, with O_DIRECT where the file system allows it (no page cache: the
// disk's own rate, and no second copy of the state in memory) and buffered I/O where it
// does not (tmpfs; a buffer or a tail not 4 KiB-aligned).
//
// A paged tensor is in one of four states, changed only by its methods:
//
//   out ──page_in──> reading ──wait──> in ──page_out(changed)──> writing ──settle──> out
//                                       └──────page_out(unchanged): freed at once──────┘
//
// While out, its storage is released (a use throws, naming the tier); while writing its
// bytes are still there, so a page_in then needs no read. A tier on the meta device (a
// dry run) does no I/O: it counts the file's bytes and pages storage in and out.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tensor/tensor.h"

namespace zg {

struct FileRequest;  // a paged tensor's read or write in flight (file_tier.cpp)

// What the tier has done, for the JSON and the benchmarks.
struct FileTierStats {
  int64_t paged_bytes = 0;    // the paged tensors' bytes: the state the file holds
  int64_t file_bytes = 0;     // the file's size: each region rounded up to 4 KiB
  int64_t bytes_read = 0, bytes_written = 0;
  double read_seconds = 0, write_seconds = 0;  // time with at least one read (write) in flight
  int64_t waits = 0;          // page-ins that had to wait for their read
  bool direct = false;        // O_DIRECT was accepted by the folder's file system
};

class FileTier {
 public:
  // `folder` must exist and be writable; `owner` names the file ("rank3"). `host` is cpu
  // (a file) or meta (counts only). `threads`: the I/O threads (requests in flight).
  FileTier(const std::string& folder, const std::string& owner, Device host, int threads = 4);
  ~FileTier();  // waits for the I/O in flight, closes the file
  FileTier(const FileTier&) = delete;
  FileTier& operator=(const FileTier&) = delete;

  Device host() const { return host_; }
  const std::string& folder() const { return folder_; }
  FileTierStats stats() const;

  struct Impl;

 private:
  friend class PagedTensor;
  std::string folder_;
  Device host_;
  std::unique_ptr<Impl> impl_;
};

class PagedTensor {
 public:
  enum class State : uint8_t { out, reading, in, writing };

  // Takes `tensor` (a contiguous host-pool tensor, materialised) into `tier`: reserves its
  // region and leaves it in. `what` names it in errors ("unit 'h.0' master weights").
  PagedTensor(std::shared_ptr<FileTier> tier, Tensor tensor, std::string what);
  ~PagedTensor();  // waits for its I/O
  PagedTensor(const PagedTensor&) = delete;  // the tier's write-behind slot points at it
  PagedTensor& operator=(const PagedTensor&) = delete;

  const Tensor& tensor() const { return tensor_; }
  State state() const { return state_; }
  // out -> reading (or in, for zeros); writing -> in, its bytes still there.
  void page_in();
  void wait();  // reading -> in; a failed read throws here
  void page_out(bool changed);  // in -> writing (changed) or out
  // page_out(true), then the tier's previous write-behind tensor settled: one such write in
  // flight at a time (a backward's gradient shards, each written as it is reduced).
  void page_out_behind();
  // writing -> out once the write is done (`block`: waiting for it); out, in: nothing.
  void settle(bool block);
  // Its contents are zeros from now on: filled if in (a write in flight finishes, out),
  // and the next page_in fills instead of reading.
  void mark_zero();

 private:
  void finish_write();
  void note_disk() const;  // a dry run's read or write, into the recording step log
  std::shared_ptr<FileTier> tier_;
  Tensor tensor_;
  std::string what_;
  int64_t offset_ = 0;
  State state_ = State::out;
  bool zeros_ = false;    // its values are zeros (page_in fills)
  bool on_file_ = false;  // the file holds its current values
  std::shared_ptr<FileRequest> request_;
};

}  // namespace zg
