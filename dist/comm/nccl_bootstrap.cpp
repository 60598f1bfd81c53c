// How the ranks of an nccl group find each other: over a host group, they first agree
// that each has a GPU of its own, then rank 0 makes the communicator's id and
// broadcasts it (nccl_group.h).
#include <unistd.h>  // gethostname

#include <cstring>
#include <functional>

#include "cuda/check.h"
#include "cuda/device.h"
#include "dist/comm/nccl_group.h"

namespace zg::dist {

namespace {

// "host/PCI bus id" of `device`, or why this rank cannot use it.
struct GpuIdentity {
  std::string name, problem;
};
GpuIdentity identify(Device device) {
  try {
    ZG_CHECK(device.type == DeviceType::cuda, "needs a cuda device, got ", device.str());
    cuda::check_device(device.index);
    char bus[32] = "";
    ZG_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, device.index));
    char hostname[256] = "";
    gethostname(hostname, sizeof hostname - 1);
    return {std::string(hostname) + "/" + bus, ""};
  } catch (const std::exception& e) {
    return {"", e.what()};
  }
}

// Before creating the communicator -- which would fail only after the timeout, saying
// no more than that a rank is missing -- the ranks agree over the host group that each
// has a GPU, and a GPU of its own (NCCL does not support two ranks on one GPU), so a
// misplaced rank fails every rank at once, naming the cause.
void agree_on_gpus(ProcessGroup& host, Device device) {
  const GpuIdentity mine = identify(device);
  const int n = host.size();
  // Each rank's [ok, hash of its identity], gathered.
  const Tensor gpu = tensor<int64_t>(
      {mine.problem.empty() ? 1 : 0, static_cast<int64_t>(std::hash<std::string>{}(mine.name))});
  const Tensor all = empty({2 * n}, DType::i64);
  host.all_gather(gpu, all);
  const std::vector<int64_t> seen = all.to_vector<int64_t>();
  ZG_CHECK(mine.problem.empty(), "nccl group: rank ", host.rank(), " cannot use ", device.str(), ": ", mine.problem);
  for (int q = 0; q < n; ++q) {
    ZG_CHECK(seen[2 * q] == 1, "nccl group: rank ", q, " cannot use its GPU (its own error says why)");
    for (int p = 0; p < q; ++p)
      ZG_CHECK(seen[2 * p + 1] != seen[2 * q + 1], "nccl group: ranks ", p, " and ", q,
               " are on one GPU (rank ", host.rank(), " is on ", mine.name,
               "): NCCL needs a GPU per rank; ranks sharing a GPU use the local group");
  }
}

}  // namespace

std::unique_ptr<ProcessGroup> NcclGroup::split(int color, int key) {
  ZG_CHECK(host_ != nullptr, "nccl group: split needs the host group it was bootstrapped over (NcclGroup::bootstrap); "
           "this one was made from an id alone");
  std::unique_ptr<ProcessGroup> host = host_->split(color, key);
  std::unique_ptr<NcclGroup> group = bootstrap(*host, device_, options_);
  group->owned_host_ = std::move(host);
  return group;
}

std::unique_ptr<NcclGroup> NcclGroup::bootstrap(ProcessGroup& host, Device device, NcclOptions options) {
  agree_on_gpus(host, device);
  NcclId id{};
  if (host.rank() == 0) id = unique_id();
  const Tensor bytes = zeros({static_cast<int64_t>(id.size() / sizeof(int64_t))}, DType::i64);
  std::memcpy(bytes.data_ptr(), id.data(), id.size());
  host.broadcast(bytes, 0);
  std::memcpy(id.data(), bytes.data_ptr(), id.size());
  return std::make_unique<NcclGroup>(id, host.rank(), host.size(), device, &host, options);
}

}  // namespace zg::dist
