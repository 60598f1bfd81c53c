// A file that appears whole or not at all. It is written as a temporary in the same
// folder ("<path>.tmp.<host>.<pid>.<n>", locked while it is written), then commit()
// fsyncs it, renames it over `path` and fsyncs the folder: a kill or a power cut at any
// moment leaves `path` as it was or as it is now, never half written. Safetensors saves,
// a sharded checkpoint's `latest` and its rank files all go through here.
//
// Temporaries of killed writers are removed by the next writer to the same path, as
// soon as no process holds their lock: a crash does not fill the disk one file at a time.
#pragma once

#include <string>
#include <string_view>

namespace zg {

class AtomicFile {
 public:
  // Removes stale temporaries of `path`, then creates and locks a new one. Refuses a
  // `path` that exists and is not a regular file (the rename would replace it); `who`
  // opens each error message.
  AtomicFile(std::string path, std::string who);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();  // without commit(): removes the temporary, leaving `path` as it was

  void write_at(const void* bytes, size_t size, int64_t offset);  // all of them, or a zg::Error
  void commit();
  const std::string& temporary() const { return temp_; }

 private:
  std::string path_, who_, temp_;
  int fd_ = -1;
  bool committed_ = false;
};

// `text` as the whole content of `path`, atomically.
void write_file_atomically(const std::string& path, std::string_view text, const std::string& who);

// What a path that is not a regular file is (its stat mode), for errors: "a directory", ...
const char* file_kind(unsigned mode);

// fsync of a folder: makes the creations, renames and removals in it durable. Best effort.
void sync_folder(const std::string& folder);

}  // namespace zg
