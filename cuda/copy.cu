// Data movement: fill, and copy between any two views -- on one GPU, between
// GPUs, and between a GPU and the host.
//
// Host <-> device semantics (the Backend::copy contract lets the caller reuse or
// free the host memory as soon as copy returns):
//   host -> device: the host data is first made contiguous in a host buffer (unless it
//     already is), then passed through the rank's page-locked staging blocks
//     (cuda/host_staging.h): the CPU copies it into a block and the DMA from there is
//     queued on the rank's stream, so copy returns without waiting for the GPU -- a
//     training loop uploading each batch never stalls on it. A copy too large to stage
//     is queued straight from the host buffer and waited for. Any cast or scatter into
//     a strided destination then runs on the device.
//   device -> host: the source is made contiguous on the device (in its own
//     dtype), copied to a host buffer, the stream waited for, and the CPU
//     backend casts/scatters into the destination -- the data is valid for the
//     host reader when copy returns. This is where kernels' deferred errors
//     (cuda/deferred_errors.h) surface.
// The host waits only in the copies to the host, unstaged uploads and copies between
// GPUs (each through wait_for_stream, counted).
#include <cstring>

#include "cuda/backend.h"
#include "cuda/deferred_errors.h"
#include "cuda/kernels.cuh"
#include "cuda/rank_state.h"
#include "tensor/backend.h"

namespace zg::cuda {

namespace {

// out[i] = value, converted as the CPU converts a double.
template <class T>
__global__ void fill_kernel(T* out, StridedIndexer<1> ix, int64_t n, double value) {
  const T v = convert<T>(value);
  for (int64_t i = grid_index(); i < n; i += grid_stride()) {
    int64_t off[1];
    ix.offsets(i, off);
    out[off[0]] = v;
  }
}

// dst[i] = convert(src[i]) for two views of one shape.
template <class From, class To>
__global__ void cast_kernel(const From* src, To* dst, StridedIndexer<2> ix, int64_t n) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) {
    int64_t off[2];
    ix.offsets(i, off);
    dst[off[0]] = convert<To>(src[off[1]]);
  }
}

bool is_cpu(const Tensor& t) { return t.device().type == DeviceType::cpu; }

// dst = src for two tensors on the same GPU (any strides and dtypes), on `stream`.
void copy_on_device(const Tensor& src, const Tensor& dst, cudaStream_t stream) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  if (src.dtype() == dst.dtype() && src.is_contiguous() && dst.is_contiguous()) {
    if (src.data_ptr() == dst.data_ptr()) return;  // copying a tensor onto itself
    ZG_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), static_cast<size_t>(dst.nbytes()),
                                  cudaMemcpyDeviceToDevice, stream));
    return;
  }
  const auto ix = make_indexer<2>(dst.shape(), {&dst.strides(), &src.strides()}, "copy");
  dispatch_device(src.dtype(), [&]<class From>() {
    dispatch_device(dst.dtype(), [&]<class To>() {
      cast_kernel<From, To><<<blocks_for(n), kThreads, 0, stream>>>(device_ptr<const From>(src), device_ptr<To>(dst), ix, n);
      ZG_CUDA_CHECK_LAUNCH();
    });
  });
}

// A contiguous tensor with src's values and dtype on src's device: src itself when it already is one.
Tensor contiguous_on_device(const Tensor& src, cudaStream_t stream) {
  if (src.is_contiguous()) return src;
  Tensor packed = Tensor::empty(src.shape(), TensorOptions(src.dtype()).device(src.device()));
  copy_on_device(src, packed, stream);
  return packed;
}

// host -> device.
void copy_to_device(const Tensor& src, const Tensor& dst) {
  OnDevice on(dst.device());
  // The host values, contiguous, in src's dtype (the CPU backend packs a strided view).
  Tensor host = src;
  if (!src.is_contiguous()) {
    host = Tensor::empty(src.shape(), TensorOptions(src.dtype()).device(kCPU));
    backend(kCPU).copy(src, host);
  }
  // Straight into dst when it has the same layout, else into a device buffer cast from afterwards.
  const bool direct = dst.is_contiguous() && dst.dtype() == src.dtype();
  const Tensor landing = direct ? dst : Tensor::empty(src.shape(), TensorOptions(src.dtype()).device(dst.device()));
  if (!rank_state(on.device).staging.copy_to_device(landing.data_ptr(), host.data_ptr(), src.nbytes(), on.stream)) {
    ZG_CUDA_CHECK(cudaMemcpyAsync(landing.data_ptr(), host.data_ptr(), static_cast<size_t>(src.nbytes()),
                                  cudaMemcpyHostToDevice, on.stream));
    wait_for_stream(on.stream);  // `host` may be freed or reused once we return
    raise_deferred_errors(on.device);
  }
  if (!direct) copy_on_device(landing, dst, on.stream);
}

// device -> host. A cast into a contiguous destination happens on the GPU first, so the
// bytes land where they belong (offload's gradient shards: page-locked, where the copy
// runs at the link's speed) and the host casts nothing.
void copy_to_host(const Tensor& src, const Tensor& dst) {
  OnDevice on(src.device());
  Tensor packed = contiguous_on_device(src, on.stream);
  if (dst.is_contiguous() && dst.dtype() != src.dtype()) {
    const Tensor cast = Tensor::empty(src.shape(), TensorOptions(dst.dtype()).device(src.device()));
    copy_on_device(packed, cast, on.stream);
    packed = cast;
  }
  const bool direct = dst.is_contiguous() && dst.dtype() == packed.dtype();
  const Tensor landing = direct ? dst : Tensor::empty(src.shape(), TensorOptions(packed.dtype()).device(kCPU));
  ZG_CUDA_CHECK(cudaMemcpyAsync(landing.data_ptr(), packed.data_ptr(), static_cast<size_t>(packed.nbytes()),
                                cudaMemcpyDeviceToHost, on.stream));
  wait_for_stream(on.stream);  // the host reads the data next
  raise_deferred_errors(on.device);
  if (!direct) backend(kCPU).copy(landing, dst);
}

// GPU -> another GPU: pack on the source GPU, peer-copy into a packed buffer on the
// destination, then cast/scatter there. Rare (ranks use one GPU each), so it simply
// waits for the source stream before the transfer and for the transfer before
// returning (the packed source buffer belongs to the source stream's allocator).
void copy_between_devices(const Tensor& src, const Tensor& dst) {
  Tensor packed;
  {
    OnDevice from(src.device());
    packed = contiguous_on_device(src, from.stream);
    wait_for_stream(from.stream);
    raise_deferred_errors(from.device);
  }
  OnDevice to(dst.device());
  const bool direct = dst.is_contiguous() && dst.dtype() == src.dtype();
  const Tensor landing = direct ? dst : Tensor::empty(src.shape(), TensorOptions(src.dtype()).device(dst.device()));
  ZG_CUDA_CHECK(cudaMemcpyPeerAsync(landing.data_ptr(), dst.device().index, packed.data_ptr(), src.device().index,
                                    static_cast<size_t>(src.nbytes()), to.stream));
  wait_for_stream(to.stream);
  if (!direct) copy_on_device(landing, dst, to.stream);
}

}  // namespace

void CudaBackend::fill(const Tensor& out, double value) {
  const int64_t n = out.numel();
  if (n == 0) return;
  OnDevice on(out.device());
  const auto ix = make_indexer<1>(out.shape(), {&out.strides()}, "fill");
  dispatch_device(out.dtype(), [&]<class T>() {
    fill_kernel<T><<<blocks_for(n), kThreads, 0, on.stream>>>(device_ptr<T>(out), ix, n, value);
    ZG_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::copy(const Tensor& src, const Tensor& dst) {
  ZG_CHECK(src.shape() == dst.shape(), "copy: shapes differ: ", describe(src), " -> ", describe(dst));
  if (dst.numel() == 0) return;
  const bool src_cpu = is_cpu(src), dst_cpu = is_cpu(dst);
  ZG_CHECK(!(src_cpu && dst_cpu), "copy: the CUDA backend was asked to copy between two CPU tensors");
  if (src_cpu) return copy_to_device(src, dst);
  if (dst_cpu) return copy_to_host(src, dst);
  if (src.device() != dst.device()) return copy_between_devices(src, dst);
  OnDevice on(dst.device());
  copy_on_device(src, dst, on.stream);
}

}  // namespace zg::cuda
