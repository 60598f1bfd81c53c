#include "dist/fake_group.h"

namespace zg::dist {

FakeGroup::FakeGroup(int rank, int size) : rank_(rank), size_(size) {
  ZG_CHECK(size >= 1 && rank >= 0 && rank < size, "fake group: rank ", rank, " of ", size, " is not valid");
}

namespace {
class Done final : public Work {
 public:
  void wait() override {}
  bool completed() const override { return true; }
};
}  // namespace

WorkHandle FakeGroup::issue(Collective) { return std::make_shared<Done>(); }

}  // namespace zg::dist
