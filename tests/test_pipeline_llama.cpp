// Pipeline parallelism composed with data and tensor parallelism, for a Llama: every
// schedule against one rank (tests/pipeline_training.h says how runs are made and compared).
#include "pipeline_training.h"

namespace zg::test {

using namespace pipeline_training;

TEST_CASE("Llama through every schedule at p in {2, 4}, m in {1, 4, 8}, alone, with dp = 2 (DDP, ZeRO-1) and with "
          "tp = 2: one rank's steps") {
  check_every_schedule(Arch::llama, {{1, 0, 1}, {2, 0, 1}, {2, 1, 1}, {1, 1, 2}});
}

}  // namespace zg::test
