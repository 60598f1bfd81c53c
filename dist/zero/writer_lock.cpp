#include "dist/zero/writer_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <mutex>

#include "dist/comm/agreement.h"

namespace zg::dist {

namespace {

constexpr const char* kLockFile = "writer.lock";

// This process's hold on a folder: the locked descriptor, closed (and so unlocked) with
// the last holder.
struct Hold {
  int fd = -1;
  ~Hold() { ::close(fd); }
};

// "pid P on host H since YYYY-MM-DD HH:MM:SS UTC": what the holder writes into the file.
std::string holder_text() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "unknown-host");
  char since[32] = {};
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  std::strftime(since, sizeof since, "%Y-%m-%d %H:%M:%S UTC", ::gmtime_r(&now, &utc));
  return "pid " + std::to_string(::getpid()) + " on host " + host + " since " + since;
}

// Who holds the lock on `fd`'s file, as its holder wrote it.
std::string holder_of(int fd) {
  char text[512] = {};
  const ssize_t n = ::pread(fd, text, sizeof text - 1, 0);
  std::string holder(text, n > 0 ? static_cast<size_t>(n) : 0);
  while (!holder.empty() && holder.back() == '\n') holder.pop_back();
  return holder.empty() ? "another process (it has not written its name yet)" : holder;
}

// Takes `dir`'s lock for this process, or shares the hold the process has.
std::shared_ptr<const Hold> hold(const std::string& dir, const std::string& who) {
  const std::string advice = "; save into a folder this user can write";
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  ZG_CHECK(!error, who, ": checkpoint folder ", dir, " cannot be created: ", error.message(), advice);
  const std::string key = std::filesystem::canonical(dir, error).string();
  ZG_CHECK(!error, who, ": checkpoint folder ", dir, " cannot be resolved: ", error.message(), advice);
  static std::mutex mutex;
  static std::map<std::string, std::weak_ptr<const Hold>> held;  // by folder: this process's holds
  const std::lock_guard<std::mutex> guard(mutex);
  if (std::shared_ptr<const Hold> existing = held[key].lock()) return existing;
  // Opened once per process: with NFS's emulation (fcntl locks), closing any descriptor of
  // the file would drop the process's lock.
  const std::string path = dir + "/" + kLockFile;
  auto taken = std::make_shared<Hold>();
  taken->fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ZG_CHECK(taken->fd >= 0, who, ": checkpoint folder ", dir, " cannot be written: creating ", path, ": ",
           std::strerror(errno), advice);
  if (::flock(taken->fd, LOCK_EX | LOCK_NB) != 0) {
    ZG_CHECK(errno == EWOULDBLOCK, who, ": cannot lock ", path, ": ", std::strerror(errno),
             "; save into a folder on a filesystem with working locks");
    fail(who, ": checkpoint folder ", dir, " is being written by ", holder_of(taken->fd),
         "; save into another folder, or stop that job first");
  }
  const std::string text = holder_text() + "\n";
  ZG_CHECK(::ftruncate(taken->fd, 0) == 0 &&
               ::pwrite(taken->fd, text.data(), text.size(), 0) == static_cast<ssize_t>(text.size()),
           who, ": checkpoint folder ", dir, " cannot be written: writing ", path, ": ", std::strerror(errno), advice);
  held[key] = taken;
  return taken;
}

}  // namespace

CheckpointWriterLock::CheckpointWriterLock(ProcessGroup& group, Device device, const std::string& dir,
                                           const std::string& who) {
  all_or_none(group, agreement_device(group, device), who, "", [&] {
    if (group.rank() == 0) held_ = hold(dir, who);
  });
}

}  // namespace zg::dist
