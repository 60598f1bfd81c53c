// Launched by tests/test_dist.cpp: two ranks of the local group, rank 0 failing at once
// and rank 1 stuck outside any collective for a minute. run_local ends the process 500 ms
// (the group's timeout) after the failure, with exit status 1 and a line on stderr; had
// it waited for rank 1, the process would exit 0 after the minute.
#include <chrono>
#include <thread>

#include "dist/comm/local_group.h"

int main() {
  using namespace std::chrono_literals;
  try {
    zg::dist::run_local(
        2,
        [](zg::dist::ProcessGroup& pg) {
          if (pg.rank() == 0) zg::fail("rank 0's data loader found no more data");
          std::this_thread::sleep_for(60s);  // no abort reaches a rank outside any collective
        },
        {500ms});
  } catch (const zg::Error&) {
  }
  return 0;
}
