#include "cuda/deferred_errors.h"

#include <map>
#include <memory>

#include "cuda/check.h"
#include "cuda/stream.h"
#include "tensor/error.h"

namespace zg::cuda {

namespace {

// One record of pinned, device-mapped host memory (cudaHostAlloc once per thread
// and device; never per op). Freed when the thread ends.
class PinnedRecord {
 public:
  explicit PinnedRecord(Device device) {
    DeviceGuard guard(device.index);
    void* host = nullptr;
    ZG_CUDA_CHECK(cudaHostAlloc(&host, sizeof(DeferredError), cudaHostAllocMapped | cudaHostAllocPortable));
    host_ = static_cast<DeferredError*>(host);
    *host_ = DeferredError{0, 0, 0, 0};
    void* mapped = nullptr;
    ZG_CUDA_CHECK(cudaHostGetDevicePointer(&mapped, host, 0));
    device_ = static_cast<DeferredError*>(mapped);
  }
  ~PinnedRecord() { cudaFreeHost(host_); }  // at thread exit: nothing to report if it fails
  PinnedRecord(const PinnedRecord&) = delete;
  PinnedRecord& operator=(const PinnedRecord&) = delete;

  volatile DeferredError* host() const { return host_; }
  DeferredError* device() const { return device_; }

 private:
  DeferredError* host_ = nullptr;
  DeferredError* device_ = nullptr;
};

PinnedRecord& record_for(Device device) {
  thread_local std::map<int, std::unique_ptr<PinnedRecord>> records;
  auto& slot = records[device.index];
  if (!slot) slot = std::make_unique<PinnedRecord>(device);
  return *slot;
}

}  // namespace

DeferredError* deferred_error_record(Device device) { return record_for(device).device(); }

void raise_deferred_errors(Device device) {
  volatile DeferredError* r = record_for(device).host();
  const auto kind = static_cast<DeferredErrorKind>(r->kind);
  if (kind == DeferredErrorKind::none) return;
  const int64_t value = r->value, bound = r->bound;
  r->kind = 0;
  const char* where = " (found by a kernel on ";
  switch (kind) {
    case DeferredErrorKind::embedding_index:
      fail("embedding: index ", value, " is out of range for a weight of ", bound, " rows", where, device.str(),
           "; reported at the next synchronisation with the host)");
    case DeferredErrorKind::embedding_backward_index:
      fail("embedding_backward: index ", value, " is out of range for a weight of ", bound, " rows", where,
           device.str(), "; reported at the next synchronisation with the host)");
    case DeferredErrorKind::cross_entropy_target:
      fail("cross_entropy: target ", value, " is out of range for ", bound, " classes", where, device.str(),
           "; reported at the next synchronisation with the host)");
    case DeferredErrorKind::cross_entropy_backward_target:
      fail("cross_entropy_backward: target ", value, " is out of range for ", bound, " classes", where, device.str(),
           "; reported at the next synchronisation with the host)");
    case DeferredErrorKind::quantize_non_finite:
      fail("quantize: element ", value, " of ", bound, " is not finite; only finite values quantize", where,
           device.str(), "; reported at the next synchronisation with the host)");
    case DeferredErrorKind::none: break;
  }
  fail("cuda: a kernel on ", device.str(), " recorded an unknown error kind ", static_cast<int>(kind));
}

}  // namespace zg::cuda
