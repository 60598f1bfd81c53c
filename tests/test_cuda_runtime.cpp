// The CUDA runtime wrappers and the caching allocator on a GPU (cuda/stream.h,
// cuda/check.h, cuda/caching_allocator.h); the allocator's logic is tested on a fake
// device in test_caching_allocator.cpp. Built only with CUDA; GPU cases report
// themselves skipped where no GPU is visible.
#include <atomic>
#include <nlohmann/json.hpp>

#include "cuda/caching_allocator.h"
#include "cuda/caching_allocator_core.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/stream.h"
#include "helpers.h"
#include "tensor/backend.h"
#include "tiny_gpt.h"

namespace zg::test {

namespace {
const bool kNoGpu = cuda::device_count() == 0;
constexpr int64_t MiB = 1 << 20;

// Holds `stream` in a host callback until release(): work queued behind it cannot finish,
// so a test can see what the allocator does while a stream is busy. Opens at the latest
// when destroyed, and waits for the callback to be done with it.
class StreamGate {
 public:
  explicit StreamGate(cudaStream_t stream) : stream_(stream) {
    ZG_CUDA_CHECK(cudaLaunchHostFunc(
        stream, [](void* gate) { while (!static_cast<StreamGate*>(gate)->open_.load()) {} }, this));
  }
  ~StreamGate() {
    release();
    cudaStreamSynchronize(stream_);
  }
  StreamGate(const StreamGate&) = delete;
  StreamGate& operator=(const StreamGate&) = delete;
  void release() { open_.store(true); }

 private:
  cudaStream_t stream_;
  std::atomic<bool> open_{false};
};
}  // namespace

TEST_CASE("every library status becomes a zg::Error naming the call and the error") {
  CHECK_THROWS_WITH_AS(ZG_CUDA_CHECK(cudaErrorInvalidValue), doctest::Contains("cudaErrorInvalidValue failed: cudaErrorInvalidValue"),
                       Error);
  CHECK_THROWS_WITH_AS(ZG_CUBLAS_CHECK(CUBLAS_STATUS_NOT_INITIALIZED),
                       doctest::Contains("CUBLAS_STATUS_NOT_INITIALIZED failed: CUBLAS_STATUS_NOT_INITIALIZED"), Error);
  CHECK_THROWS_WITH_AS(ZG_CUDNN_CHECK(CUDNN_STATUS_BAD_PARAM), doctest::Contains("failed: CUDNN_STATUS_BAD_PARAM"), Error);
  CHECK_THROWS_WITH_AS(ZG_NCCL_CHECK(ncclInvalidArgument), doctest::Contains("ncclInvalidArgument failed: invalid argument"),
                       Error);
  CHECK_THROWS_WITH_AS(ZG_NCCL_CHECK(ncclInvalidArgument), doctest::Contains("test_cuda_runtime.cpp:"), Error);
  CHECK_NOTHROW(ZG_CUDA_CHECK(cudaSuccess));
  CHECK_NOTHROW(ZG_CUBLAS_CHECK(CUBLAS_STATUS_SUCCESS));
  CHECK_NOTHROW(ZG_CUDNN_CHECK(CUDNN_STATUS_SUCCESS));
  CHECK_NOTHROW(ZG_NCCL_CHECK(ncclSuccess));
}

TEST_CASE("the stream and allocator entry points refuse a GPU that is not there") {
  const Device missing(DeviceType::cuda, cuda::device_count());
  CHECK_THROWS_WITH_AS(cuda::current_stream(missing), doctest::Contains("does not exist"), Error);
  CHECK_THROWS_WITH_AS(cuda::communication_stream(missing), doctest::Contains("does not exist"), Error);
  CHECK_THROWS_WITH_AS(cuda::make_caching_allocator(missing), doctest::Contains("does not exist"), Error);
  CHECK_THROWS_WITH_AS(cuda::current_stream(kCPU), doctest::Contains("is not a GPU"), Error);
}

TEST_CASE("each rank context has its own non-blocking compute and communication streams" * doctest::skip(kNoGpu)) {
  Context r0(0), r1(1);
  cudaStream_t compute0 = nullptr, comm0 = nullptr, compute1 = nullptr;
  {
    ContextGuard guard(r0);
    compute0 = cuda::current_stream(kCUDA);
    comm0 = cuda::communication_stream(kCUDA);
    CHECK(cuda::current_stream(kCUDA) == compute0);  // made once
  }
  {
    ContextGuard guard(r1);
    compute1 = cuda::current_stream(kCUDA);
  }
  CHECK(compute0 != nullptr);
  CHECK(compute0 != comm0);
  CHECK(compute0 != compute1);
  unsigned int flags = 0;
  ZG_CUDA_CHECK(cudaStreamGetFlags(compute0, &flags));
  CHECK(flags == cudaStreamNonBlocking);
}

TEST_CASE("DeviceGuard restores the device, events order two streams" * doctest::skip(kNoGpu)) {
  int before = -1, after = -1;
  ZG_CUDA_CHECK(cudaGetDevice(&before));
  { cuda::DeviceGuard guard(0); }
  ZG_CUDA_CHECK(cudaGetDevice(&after));
  CHECK(before == after);

  cuda::Stream producer(0), consumer(0);
  CHECK(producer.device() == 0);
  StreamGate gate(producer.get());
  cuda::Event produced;
  produced.record(producer.get());
  produced.block(consumer.get());
  cuda::Event consumed;
  consumed.record(consumer.get());
  CHECK_FALSE(produced.query());  // the gate holds the producer...
  CHECK_FALSE(consumed.query());  // ...and the consumer waits for it
  gate.release();
  consumed.synchronize();
  CHECK(produced.query());
  CHECK(consumed.query());
}

TEST_CASE("the caching allocator on cuda:0: reuse, cap, device out of memory, empty_cache, snapshot" * doctest::skip(kNoGpu)) {
  Context rank;
  ContextGuard guard(rank);
  const std::shared_ptr<Allocator> allocator = cuda::make_caching_allocator(kCUDA);
  auto& caching = dynamic_cast<cuda::CachingAllocator&>(*allocator);

  const Allocation a = allocator->allocate(1000, MemoryCategory::activation);
  CHECK(allocator->stats().reserved == 2 * MiB);
  ZG_CUDA_CHECK(cudaMemsetAsync(a.ptr, 0, 1000, cuda::current_stream(kCUDA)));
  allocator->deallocate(a);
  const Allocation again = allocator->allocate(1000, MemoryCategory::activation);
  CHECK(again.ptr == a.ptr);  // same stream: reused at once
  allocator->deallocate(again);

  allocator->set_cap(4 * MiB);
  CHECK_THROWS_WITH_AS(allocator->allocate(3 * MiB, MemoryCategory::workspace), doctest::Contains("over the memory cap"),
                       OutOfMemory);
  allocator->set_cap(0);
  CHECK_THROWS_WITH_AS(allocator->allocate(int64_t{1} << 45, MemoryCategory::workspace),
                       doctest::Contains("the device is full"), OutOfMemory);  // 32 TiB: cudaMalloc fails
  const Allocation after_oom = allocator->allocate(1000, MemoryCategory::other);  // the failure was cleared
  allocator->deallocate(after_oom);

  caching.empty_cache();
  CHECK(allocator->stats().reserved == 0);
  const nlohmann::json doc = nlohmann::json::parse(caching.snapshot_json());
  CHECK(doc["events"].front()["action"] == "segment_alloc");
  CHECK(doc["events"].back()["action"] == "segment_free");
}

TEST_CASE("a block freed while another stream still uses it waits for that stream" * doctest::skip(kNoGpu)) {
  Context rank;
  ContextGuard guard(rank);
  const std::shared_ptr<Allocator> allocator = cuda::make_caching_allocator(kCUDA);
  cudaStream_t comm = cuda::communication_stream(kCUDA);
  StreamGate gate(comm);
  void* used = nullptr;
  {
    const Tensor bucket = tensor_over(allocator, 1024, MemoryCategory::communication);
    used = bucket.data_ptr();
    ZG_CUDA_CHECK(cudaMemsetAsync(used, 0, 4096, comm));
    cuda::record_stream(bucket, comm);
  }  // freed while the gate holds the communication stream
  const Allocation while_busy = allocator->allocate(4096, MemoryCategory::communication);
  CHECK(while_busy.ptr != used);
  gate.release();
  ZG_CUDA_CHECK(cudaStreamSynchronize(comm));
  const Allocation when_done = allocator->allocate(4096, MemoryCategory::communication);
  CHECK(when_done.ptr == used);
  allocator->deallocate(while_busy);
  allocator->deallocate(when_done);
}

TEST_CASE("a GPU tensor that outlives its rank's context still frees its block" * doctest::skip(kNoGpu)) {
  Tensor survivor;
  std::shared_ptr<Allocator> allocator;
  {
    Context rank(1);
    ContextGuard guard(rank);
    allocator = rank.allocator(kCUDA);
    survivor = randn({1024}, TensorOptions(DType::f32).device(kCUDA));
    cuda::record_stream(survivor, cuda::communication_stream(kCUDA));  // as a collective's buffer
    backend(kCUDA).synchronize(kCUDA);
  }  // the context is gone; the allocator holds the rank's streams
  survivor = Tensor();  // marked on the rank's communication stream, which must still exist
  ZG_CUDA_CHECK(cudaDeviceSynchronize());
  auto& caching = dynamic_cast<cuda::CachingAllocator&>(*allocator);
  caching.empty_cache();  // the mark is passed: the block is free, its segment given back
  CHECK(allocator->stats().allocated_total == 0);
  CHECK(allocator->stats().reserved == 0);
}

TEST_CASE("over 100 identical training steps on cuda:0, reserved bytes stop growing" * doctest::skip(kNoGpu)) {
  Context rank;  // a fresh allocator: its figures are this test's alone
  ContextGuard guard(rank);
  TinyTrainer trainer(DType::bf16, false, 1, 0.0, kCUDA);
  const Sequence data = fixed_sequence();
  std::vector<MemoryStats> after;
  for (int step = 0; step < 100; ++step) {
    trainer.step(data, 1e-3);
    after.push_back(memory_stats(kCUDA));
  }
  for (int step = 5; step < 100; ++step) {
    INFO("step " << step);
    CHECK(after[step].reserved == after[4].reserved);
    CHECK(after[step].segment_allocations == after[4].segment_allocations);  // no cudaMalloc after warm-up
    CHECK(after[step].allocated == after[4].allocated);                      // every category, byte for byte
  }
  // bf16 weights and grads, f32 master + m + v: 16 bytes a parameter, as on the CPU.
  const int64_t n = trainer.model->num_parameters();
  CHECK(after.back()[MemoryCategory::parameter] >= 2 * n);
  CHECK(after.back()[MemoryCategory::optimizer_state] >= 12 * n);
}

}  // namespace zg::test
