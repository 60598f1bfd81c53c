// The nccl process group. NCCL runs one rank per GPU and the GPU machines this is
// tested on have one, so these cases use a one-rank communicator (bootstrapped
// through a host group, as under mpirun) and check what does not need a second GPU:
// values, the stream semantics of Work, byte counts, the watchdog's error path and a
// sharded training run. Built only with CUDA; skipped where no GPU is visible.
#include "cuda/device.h"
#include "dist/comm/local_group.h"
#include "dist/comm/nccl_group.h"
#include "helpers.h"
#include "zero_training.h"

namespace zg::test {

namespace {
const bool kNoGpu = cuda::device_count() == 0;
}

TEST_CASE("a one-rank nccl group: collectives, asynchronous waits and byte counts" * doctest::skip(kNoGpu)) {
  dist::run_local(1, [](dist::ProcessGroup& host) {
    const auto nccl = dist::NcclGroup::bootstrap(host, kCUDA);
    CHECK(nccl->kind() == "nccl");
    CHECK(nccl->size() == 1);
    const TensorOptions gpu = TensorOptions(DType::f32).device(kCUDA);

    Tensor a = arange(6, gpu);
    const dist::WorkHandle work = nccl->all_reduce_async(a, dist::ReduceKind::average);
    work->wait();  // the compute stream now waits for it; reading `a` is ordered after
    CHECK(a.to_vector<double>() == std::vector<double>{0, 1, 2, 3, 4, 5});
    CHECK(work->completed());  // (to_vector synchronised the host)

    const Tensor shard = zeros({6}, gpu), gathered = zeros({6}, gpu);
    nccl->reduce_scatter(a, shard);
    nccl->all_gather(shard, gathered);
    Tensor b = full({3}, 7.0, TensorOptions(DType::bf16).device(kCUDA));
    nccl->broadcast(b, 0);
    nccl->barrier();
    CHECK(gathered.to_vector<double>() == a.to_vector<double>());
    CHECK(b.to_vector<double>() == std::vector<double>{7, 7, 7});
    CHECK(nccl->bytes_sent() == 0);  // (N - 1) / N of everything, N = 1

    CHECK_THROWS_WITH_AS(nccl->all_reduce(zeros({4})), doctest::Contains("needs contiguous tensors on cuda:0"), Error);
    // (A bool all_reduce is refused before the group: no sum of bools. A broadcast reaches it.)
    CHECK_THROWS_WITH_AS(nccl->broadcast(zeros({4}, TensorOptions(DType::boolean).device(kCUDA)), 0),
                         doctest::Contains("no NCCL type for bool"), Error);
  });
}

TEST_CASE("ZeRO on a one-rank nccl group trains like the local group on the same GPU" * doctest::skip(kNoGpu)) {
  for (int stage = 0; stage <= 3; ++stage) {
    INFO("stage " << stage);
    nn::NamedTensors over_nccl, over_local;
    dist::run_local(1, [&](dist::ProcessGroup& host) {
      const auto nccl = dist::NcclGroup::bootstrap(host, kCUDA);
      over_nccl = train_sharded(*nccl, {.dtype = DType::f32, .stage = stage, .steps = 3, .device = kCUDA});
      over_local = train_sharded(host, {.dtype = DType::f32, .stage = stage, .steps = 3, .device = kCUDA});
    });
    REQUIRE(over_nccl.size() == over_local.size());
    for (size_t i = 0; i < over_nccl.size(); ++i) {
      INFO(over_nccl[i].first);
      CHECK(max(abs(over_nccl[i].second - over_local[i].second)).item<double>() <= 1e-6);
    }
  }
}

TEST_CASE("nccl group arguments are checked before anything is created" * doctest::skip(kNoGpu)) {
  const dist::NcclId id = dist::NcclGroup::unique_id();
  CHECK_THROWS_WITH_AS(dist::NcclGroup(id, 0, 1, kCPU), "nccl group: needs a cuda device, got cpu", Error);
  CHECK_THROWS_WITH_AS(dist::NcclGroup(id, 2, 2, kCUDA), "nccl group: rank 2 of 2 is not valid", Error);
  CHECK_THROWS_WITH_AS(dist::NcclGroup(id, 0, 1, kCUDA, nullptr, {.timeout = std::chrono::milliseconds(0)}),
                       "nccl group: the timeout must be positive, got 0 ms", Error);
}

TEST_CASE("a rank that never joins ends the others' communicator creation after the timeout" * doctest::skip(kNoGpu)) {
  // Rank 1 of 2 never arrives. A blocking ncclCommInitRank would wait for it for ever;
  // the non-blocking one is polled and aborted when the timeout passes.
  const dist::NcclId id = dist::NcclGroup::unique_id();
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(dist::NcclGroup(id, 0, 2, kCUDA, nullptr, {.timeout = std::chrono::milliseconds(2000)}),
                       "nccl group: creating the communicator (rank 0 of 2) did not finish within 2000 ms (a rank is "
                       "missing, failed or stuck)",
                       Error);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
  // The GPU is still usable.
  CHECK(sum(ones({4}, TensorOptions(DType::f32).device(kCUDA))).item<double>() == 4);
}

}  // namespace zg::test
