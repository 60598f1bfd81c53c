#include "cuda/check.h"

namespace zg::cuda {

void check(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS)
    fail(call, " failed: ", cublasGetStatusName(status), " (", cublasGetStatusString(status), ") at ", file, ":", line);
}

void check(cudnnStatus_t status, const char* call, const char* file, int line) {
  if (status == CUDNN_STATUS_SUCCESS) return;
  char detail[512] = "";  // cuDNN 9 keeps the reason of its last failure on this thread
  cudnnGetLastErrorString(detail, sizeof detail);
  fail(call, " failed: ", cudnnGetErrorString(status), detail[0] ? std::string(" (") + detail + ")" : std::string(),
       " at ", file, ":", line);
}

void check(ncclResult_t status, const char* call, const char* file, int line) {
  if (status == ncclSuccess) return;
  const char* detail = ncclGetLastError(nullptr);  // what NCCL logged about its last failure
  fail(call, " failed: ", ncclGetErrorString(status), detail && detail[0] ? std::string(" (") + detail + ")" : std::string(),
       " at ", file, ":", line);
}

}  // namespace zg::cuda
