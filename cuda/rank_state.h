// What one rank keeps per GPU, in its context's backend_state slot
// (tensor/context.h): its compute and communication streams, its host staging
// blocks, and the place for the library handles the backend needs per rank. Created
// on first use. Held by the context and by the rank's caching allocator for the GPU
// (cuda/caching_allocator.cu), so it lives until both are gone: a tensor that outlives
// its rank's context still frees its block against streams that exist.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cudnn.h>

#include <memory>
#include <mutex>

#include "cuda/host_staging.h"
#include "cuda/stream.h"
#include "tensor/device.h"

namespace zg::cuda {

struct AttentionGraphs;  // cuda/attention.cu

struct RankState {
  explicit RankState(int device) : compute(device), communication(device), staging(device), device_(device) {}
  ~RankState();  // the library handles go before the streams they were last given
  RankState(const RankState&) = delete;
  RankState& operator=(const RankState&) = delete;

  Stream compute;        // every kernel of the rank, in issue order
  Stream communication;  // collectives, so they overlap compute
  HostStaging staging;   // page-locked blocks host -> device copies pass through (goes before the streams)

  // The rank's cuBLAS handle, made on first use (full-precision math: no TF32, no
  // reduced-precision reductions). Callers set its stream and workspace on every call.
  cublasHandle_t cublas();
  // The rank's cuBLASLt handle (GEMMs with epilogues, cuda/linear.cu), made on first use.
  cublasLtHandle_t cublas_lt();

  // The rank's cuDNN handle, made on first use. Callers set its stream on every call.
  cudnnHandle_t cudnn();

  // The rank's fused-attention graphs, by layout (cuda/attention.cu, which alone sees
  // the type, so the cuDNN frontend's headers stay in that one file). Made on first use
  // under the mutex, which also guards every lookup; dropped before the cuDNN handle
  // their plans were built with.
  std::mutex attention_mutex;
  std::shared_ptr<AttentionGraphs> attention_graphs;

 private:
  int device_;
  std::once_flag cublas_made_, cublas_lt_made_, cudnn_made_;
  cublasHandle_t cublas_ = nullptr;
  cublasLtHandle_t cublas_lt_ = nullptr;
  cudnnHandle_t cudnn_ = nullptr;
};

// The current rank context's state for `device`; throws zg::Error for a device that is
// not a visible GPU.
RankState& rank_state(Device device);
// The same, shared: for holders that must keep the streams alive (the caching allocator).
std::shared_ptr<RankState> shared_rank_state(Device device);

}  // namespace zg::cuda
