// Built only with CUDA. GPU cases report themselves skipped where no GPU is visible.
#include "cuda/device.h"
#include "helpers.h"

namespace zg::test {

TEST_CASE("device discovery works with or without a GPU") {
  const int count = cuda::device_count();
  CHECK(count >= 0);
  CHECK_THROWS_WITH_AS(cuda::device_description(count), doctest::Contains("does not exist"), Error);
}

TEST_CASE("a visible GPU describes itself" * doctest::skip(cuda::device_count() == 0)) {
  const std::string description = cuda::device_description(0);
  MESSAGE(description);
  CHECK(description.find("sm_") != std::string::npos);
}

}  // namespace zg::test
