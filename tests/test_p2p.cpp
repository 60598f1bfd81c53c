// Point-to-point messages (ProcessGroup::send_async, recv_async, batch_async) on the
// local and fake groups: pairing in order, crossing sends that do not deadlock, bytes
// counted on the sender, and every mismatch or missing partner a named error on both
// ends, at once rather than at the timeout. (The mpi group's: test_mpi.)
#include <atomic>
#include <chrono>
#include <mutex>

#include "dist/comm/device_mesh.h"
#include "dist/comm/fake_group.h"
#include "dist/comm/local_group.h"
#include "helpers.h"

namespace zg::test {

using dist::P2POp;
using dist::ProcessGroup;
using namespace std::chrono_literals;

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// What each rank's fn threw (or ""), and how long it took; run_local itself must not throw.
struct Ends {
  std::vector<std::string> errors;
  std::vector<double> seconds;
};
Ends run_catching(int n, const std::function<void(ProcessGroup&)>& fn) {
  Ends ends{std::vector<std::string>(n), std::vector<double>(n)};
  std::mutex mutex;
  dist::run_local(
      n,
      [&](ProcessGroup& pg) {
        const Clock::time_point start = Clock::now();
        std::string error;
        try {
          fn(pg);
        } catch (const Error& e) {
          error = e.what();
        }
        std::lock_guard lock(mutex);
        ends.errors[pg.rank()] = error, ends.seconds[pg.rank()] = seconds_since(start);
      },
      {.timeout = 60s});
  return ends;
}
}  // namespace

TEST_CASE("a ring of sends and receives delivers each rank's tensor to the next, at N = 2, 3, 4") {
  for (int n : {2, 3, 4}) {
    INFO("world size " << n);
    dist::run_local(n, [n](ProcessGroup& pg) {
      const int r = pg.rank(), next = (r + 1) % n, previous = (r + n - 1) % n;
      const Tensor mine = full({2, 3}, 10.0 * r + 1);
      const Tensor got = zeros({6});  // matched by dtype and numel, not shape
      // Every rank sends first: posted, not blocking, so the ring does not deadlock.
      dist::WorkHandle sent = pg.send_async(mine, next, 7);
      pg.recv(got, previous, 7);
      sent->wait();
      CHECK(sent->completed());
      CHECK(got.to_vector<float>() == std::vector<float>(6, static_cast<float>(10.0 * previous + 1)));
      CHECK(pg.bytes_sent() == 6 * 4);  // the sender counts the message; a receive sends nothing
    });
  }
}

TEST_CASE("messages between two ranks pair in the order posted, and a batch crosses both ways at once") {
  dist::run_local(2, [](ProcessGroup& pg) {
    const int peer = 1 - pg.rank();
    std::vector<Tensor> outgoing, incoming;
    std::vector<P2POp> ops;
    for (int k = 0; k < 3; ++k) {
      outgoing.push_back(full({k + 1}, 100.0 * pg.rank() + k, DType::f64));
      incoming.push_back(zeros({k + 1}, DType::f64));
      ops.push_back({P2POp::send, outgoing.back(), peer, k});
      ops.push_back({P2POp::recv, incoming.back(), peer, k});
    }
    dist::WorkHandle all = pg.batch_async(ops);  // both ranks post sends before receives
    all->wait();
    for (int k = 0; k < 3; ++k) CHECK(incoming[k].to_vector<double>() == std::vector<double>(k + 1, 100.0 * peer + k));
  });
}

TEST_CASE("a mismatched send and receive fail both ends within a second, each naming both calls") {
  const auto check_both = [](const Ends& ends, const std::string& expected) {
    for (int r = 0; r < 2; ++r) {
      INFO("rank " << r);
      CHECK(ends.errors[r].find(expected) != std::string::npos);
      CHECK(ends.seconds[r] < 1.0);
    }
  };
  // Another size.
  check_both(run_catching(2,
                          [](ProcessGroup& pg) {
                            if (pg.rank() == 0) pg.send(zeros({4}), 1, 1);
                            else pg.recv(zeros({8}), 0, 1);
                          }),
             "local group: message #0 from rank 0 to rank 1 does not match: rank 0 sent send(f32[4] on cpu, to rank "
             "1, tag 1), rank 1 receives recv(f32[8] on cpu, from rank 0, tag 1)");
  // Another tag (the second message: the first pair matched) and another dtype.
  check_both(run_catching(2,
                          [](ProcessGroup& pg) {
                            if (pg.rank() == 0) {
                              pg.send(zeros({2}), 1, 1);
                              pg.send(zeros({2}), 1, 2);
                            } else {
                              pg.recv(zeros({2}), 0, 1);
                              pg.recv(zeros({2}), 0, 3);
                            }
                          }),
             "message #1 from rank 0 to rank 1 does not match: rank 0 sent send(f32[2] on cpu, to rank 1, tag 2), "
             "rank 1 receives recv(f32[2] on cpu, from rank 0, tag 3)");
  check_both(run_catching(2,
                          [](ProcessGroup& pg) {
                            if (pg.rank() == 1) pg.send(zeros({2}, DType::f64), 0);
                            else pg.recv(zeros({2}), 1);
                          }),
             "rank 1 sent send(f64[2] on cpu, to rank 0), rank 0 receives recv(f32[2] on cpu, from rank 1)");
}

TEST_CASE("a message whose partner never comes ends at once if the peer returned, else at the timeout") {
  const Ends gone = run_catching(2, [](ProcessGroup& pg) {
    if (pg.rank() == 0) pg.recv(zeros({3}), 1, 5);
  });
  CHECK(gone.errors[0] ==
        "local group: rank 0's recv(f32[3] on cpu, from rank 1, tag 5) (message #0) waits for rank 1, which returned "
        "from its function without posting the matching send");
  CHECK(gone.seconds[0] < 1.0);
  CHECK(gone.errors[1].empty());
  // A peer still there but busy elsewhere: the group's timeout.
  CHECK_THROWS_WITH_AS(dist::run_local(
                           2,
                           [](ProcessGroup& pg) {
                             if (pg.rank() == 0) pg.send(zeros({3}), 1);
                             else {  // busy, then in a collective rank 0 never calls (woken by its failure)
                               std::this_thread::sleep_for(100ms);
                               pg.barrier();
                             }
                           },
                           {.timeout = 200ms}),
                       doctest::Contains("rank 0: local group: rank 0's send(f32[3] on cpu, to rank 1) (message #0) "
                                         "timed out after 200 ms: rank 1 has not posted the matching receive"),
                       Error);
  // A rank that fails wakes its peer's pending message with its error.
  CHECK_THROWS_WITH_AS(dist::run_local(2,
                                       [](ProcessGroup& pg) {
                                         if (pg.rank() == 0) pg.recv(zeros({3}), 1);
                                         else throw Error("rank 1 gave up");
                                       }),
                       doctest::Contains("rank 1: rank 1 gave up"), Error);
}

TEST_CASE("a message to itself, to no rank, from a strided view or into a tensor that requires grad is refused up front") {
  dist::run_local(2, [](ProcessGroup& pg) {
    const int self = pg.rank();
    const std::string to_self = "send: peer " + std::to_string(self) + " is not another rank of this group (rank " +
                                std::to_string(self) + " of 2)";
    CHECK_THROWS_WITH_AS(pg.send(zeros({2}), self), doctest::Contains(to_self.c_str()), Error);
    CHECK_THROWS_WITH_AS(pg.recv(zeros({2}), 2), doctest::Contains("recv: peer 2 is not another rank"), Error);
    CHECK_THROWS_WITH_AS(pg.send(zeros({2, 2}).transpose(0, 1), 1 - self), doctest::Contains("send: the tensor"), Error);
    CHECK_THROWS_WITH_AS(pg.recv(zeros({2}).set_requires_grad(), 1 - self), doctest::Contains("recv"), Error);
    CHECK(pg.bytes_sent() == 0);  // nothing refused was counted
    // A batch with one bad message posts none of them: the group is still in step.
    const Tensor a = zeros({2});
    CHECK_THROWS_AS(pg.batch_async({{P2POp::send, a, 1 - self, 0}, {P2POp::recv, a, self, 0}}), Error);
    const Tensor got = zeros({1});
    pg.batch_async({{P2POp::send, full({1}, self + 1.0), 1 - self, 0}, {P2POp::recv, got, 1 - self, 0}})->wait();
    CHECK(got.item<float>() == 2.0f - self);
  });
}

TEST_CASE("a mesh dimension's group carries messages between its own ranks (pipeline stages)") {
  dist::run_local(4, [](ProcessGroup& world) {
    dist::DeviceMesh mesh(world, {{"pp", 2}, {"dp", 2}});
    ProcessGroup& pp = mesh.group("pp");
    const Tensor got = zeros({1});
    if (pp.rank() == 0) pp.send(full({1}, static_cast<double>(world.rank())), 1);
    else pp.recv(got, 0);
    if (pp.rank() == 1) CHECK(got.item<float>() == static_cast<float>(world.rank() - 2));  // pp stride 2
  });
}

TEST_CASE("the fake group counts messages, moves nothing, and refuses to make up a received tensor") {
  dist::FakeGroup fake(0, 4);
  fake.send(zeros({8}, TensorOptions(DType::bf16).device(kMeta)), 1);
  fake.recv(zeros({8}, TensorOptions(DType::bf16).device(kMeta)), 3);
  CHECK(fake.bytes_sent() == 16);
  fake.send(zeros({2}), 1);  // a tensor with data goes nowhere
  CHECK_THROWS_WITH_AS(fake.recv(zeros({2}), 1),
                       doctest::Contains("fake group: rank 0 of 4 cannot receive recv(f32[2] on cpu, from rank 1) into "
                                         "a tensor with data"),
                       Error);
}

}  // namespace zg::test
