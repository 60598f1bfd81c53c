// zg::Error: every bad input reachable from the public API ends here, with a
// message that names the op and the shapes, dtypes and devices involved.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace zg {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An allocation did not fit (a real device, or a memory cap that simulates one).
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// Streams every argument into one string: a message, or a reason kept for later.
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  return message.str();
}

// Streams every argument into one message and throws it as zg::Error.
template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  throw Error(concat(parts...));
}

}  // namespace zg

// ZG_CHECK(cond, "op: ", ...) throws zg::Error built from the remaining arguments.
#define ZG_CHECK(cond, ...)                       \
  do {                                            \
    if (!(cond)) ::zg::fail(__VA_ARGS__);         \
  } while (0)
