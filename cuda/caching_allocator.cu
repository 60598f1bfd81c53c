// The caching allocator on a real GPU: the CUDA-independent core
// (caching_allocator_core.h) with cudaMalloc / cudaFree for segments, the rank's
// compute stream for ordering, and CUDA events as stream markers.
#include "cuda/caching_allocator.h"

#include "cuda/caching_allocator_core.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/rank_state.h"
#include "cuda/stream.h"

namespace zg::cuda {

namespace {

StreamId id_of(cudaStream_t stream) { return StreamId{reinterpret_cast<std::uintptr_t>(stream)}; }
cudaStream_t stream_of(StreamId id) { return reinterpret_cast<cudaStream_t>(static_cast<std::uintptr_t>(id)); }

class EventMarker final : public StreamMarker {
 public:
  explicit EventMarker(cudaStream_t stream) { event_.record(stream); }
  bool done() const override { return event_.query(); }
  void wait() const override { event_.synchronize(); }

 private:
  Event event_;
};

class DeviceMemory final : public MemorySource {
 public:
  explicit DeviceMemory(Device device) : device_(device) {}

  void* allocate_segment(int64_t bytes) override {
    DeviceGuard guard(device_.index);
    void* ptr = nullptr;
    const cudaError_t status = cudaMalloc(&ptr, static_cast<size_t>(bytes));
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // the allocator answers with its cache, a retry, or OutOfMemory
      return nullptr;
    }
    ZG_CUDA_CHECK(status);
    return ptr;
  }

  // cudaFree waits for the device's work, and while it waits it holds a driver lock that
  // other threads' launches need: with NCCL ranks as threads of one process, a collective
  // in flight here waits for a peer whose host is stuck launching behind that lock -- a
  // hang (NCCL's documented cudaFree pitfall). So the device is drained first, holding
  // nothing; cudaFree then has nothing to wait for. (Only the release path comes here:
  // empty_cache, the out-of-memory retry, the allocator's end.)
  void free_segment(void* ptr) override {
    DeviceGuard guard(device_.index);
    ZG_CUDA_CHECK(cudaDeviceSynchronize());
    ZG_CUDA_CHECK(cudaFree(ptr));
  }

  // The first call takes a share of the rank's state: the streams that blocks are
  // ordered on (and marked on at their free) must outlive every block, and a tensor
  // may outlive its rank's context. (Not in the constructor: that runs under the
  // context's lock, which rank_state takes too.)
  StreamId current_stream() override {
    if (!streams_) streams_ = shared_rank_state(device_);
    return id_of(cuda::current_stream(device_));
  }

  std::unique_ptr<StreamMarker> mark(StreamId stream) override {
    DeviceGuard guard(device_.index);  // an event belongs to the device current at its creation
    return std::make_unique<EventMarker>(stream_of(stream));
  }

 private:
  Device device_;
  std::shared_ptr<RankState> streams_;
};

}  // namespace

std::shared_ptr<Allocator> make_caching_allocator(Device device) {
  ZG_CHECK(device.type == DeviceType::cuda, "make_caching_allocator: ", device.str(), " is not a GPU");
  check_device(device.index);
  return std::make_shared<CachingAllocator>(device, std::make_unique<DeviceMemory>(device));
}

void record_stream(const Tensor& tensor, cudaStream_t stream) { record_stream(tensor, id_of(stream)); }

}  // namespace zg::cuda
