#include "tensor/atomic_file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "tensor/error.h"
#include "tensor/safetensors.h"

namespace zg {

namespace {

std::string errno_text() { return std::strerror(errno); }

// "<path>.tmp.<host>.<pid>.<n>": whose it is, for a reader of the folder.
std::string temporary_name(const std::string& path) {
  static std::atomic<uint64_t> files{0};  // a name of its own per call: threads may write one path
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "unknown-host");
  return path + ".tmp." + host + "." + std::to_string(::getpid()) + "." + std::to_string(files++);
}

// Removes the temporaries of `path` that writers killed part-way left behind: those no
// process holds locked. A live writer holds its lock from just after creating the file
// until the rename (on any host or PID namespace sharing the folder: flock works over NFS
// too), and one that loses its file in that instant makes another (create_locked). Best
// effort: what cannot be listed, opened or removed stays.
void remove_stale_temporaries(const std::string& path) {
  const std::filesystem::path target(path);
  const std::string prefix = target.filename().string() + ".tmp.";
  const std::filesystem::path folder = target.has_parent_path() ? target.parent_path() : ".";
  std::error_code error;
  std::filesystem::directory_iterator it(folder, error), end;
  for (; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    // "<prefix><host>.<pid>.<n>": the last two fields are numbers.
    if (!name.starts_with(prefix)) continue;
    const size_t last = name.find_last_of('.'), before = name.find_last_of('.', last - 1);
    uint64_t pid = 0, n = 0;
    if (before == std::string::npos || before < prefix.size() ||
        !parse_number(std::string_view(name).substr(before + 1, last - before - 1), pid) ||
        !parse_number(std::string_view(name).substr(last + 1), n))
      continue;
    const int fd = ::open(it->path().c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) continue;
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) ::unlink(it->path().c_str());
    ::close(fd);
  }
}

// A new temporary for `path`, created and locked: its descriptor. Between the create and
// the lock, a cleaner in another process may take the unlocked file for a killed
// writer's and remove it; then the name no longer leads to our file, and we make another.
int create_locked(const std::string& path, std::string& temp, const std::string& who) {
  for (int attempt = 0;; ++attempt) {
    temp = temporary_name(path);
    const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    ZG_CHECK(fd >= 0, who, ": cannot create ", temp, ": ", errno_text());
    ::flock(fd, LOCK_EX);  // (on a filesystem without locks no cleaner can lock it either)
    struct stat opened {}, named {};
    if (::fstat(fd, &opened) == 0 && ::stat(temp.c_str(), &named) == 0 && opened.st_dev == named.st_dev &&
        opened.st_ino == named.st_ino)
      return fd;
    ::close(fd);
    ZG_CHECK(attempt < 100, who, ": ", temp, " was removed as soon as it was made, 100 times over");
  }
}

std::string folder_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

}  // namespace

const char* file_kind(unsigned mode) {
  return S_ISDIR(mode) ? "a directory" : S_ISLNK(mode) ? "a symbolic link" : "a FIFO, socket or device";
}

AtomicFile::AtomicFile(std::string path, std::string who) : path_(std::move(path)), who_(std::move(who)) {
  // Only a regular file may be replaced: a symlink would be replaced, not written
  // through; a device node by a plain file.
  struct stat existing {};
  if (::lstat(path_.c_str(), &existing) == 0)
    ZG_CHECK(S_ISREG(existing.st_mode), who_, ": ", path_, " exists and is not a regular file (",
             file_kind(existing.st_mode), "); it is not replaced");
  remove_stale_temporaries(path_);  // first: a disk that earlier crashes filled may be why this one fails
  fd_ = create_locked(path_, temp_, who_);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_.c_str());
}

void AtomicFile::write_at(const void* bytes, size_t size, int64_t offset) {
  ZG_CHECK(fd_ >= 0, who_, ": ", path_, " was committed already");
  const char* p = static_cast<const char*>(bytes);
  while (size > 0) {
    const ssize_t n = ::pwrite(fd_, p, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    ZG_CHECK(n > 0, who_, ": writing ", temp_, " failed: ", errno_text());
    p += n;
    offset += n;
    size -= static_cast<size_t>(n);
  }
}

void AtomicFile::commit() {
  ZG_CHECK(fd_ >= 0, who_, ": ", path_, " was committed already");
  ZG_CHECK(::fsync(fd_) == 0, who_, ": fsync of ", temp_, " failed: ", errno_text());
  // Renamed while still locked: no cleaner can take the finished temporary for a killed one.
  if (::rename(temp_.c_str(), path_.c_str()) != 0)
    fail(who_, ": cannot rename ", temp_, " to ", path_, ": ", errno_text());  // the destructor unlinks temp_
  committed_ = true;
  ::close(fd_);
  fd_ = -1;
  sync_folder(folder_of(path_));  // the rename itself, durable
}

void write_file_atomically(const std::string& path, std::string_view text, const std::string& who) {
  AtomicFile file(path, who);
  file.write_at(text.data(), text.size(), 0);
  file.commit();
}

void sync_folder(const std::string& folder) {
  const int dir = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return;
  ::fsync(dir);
  ::close(dir);
}

}  // namespace zg
