// Staging between device memory and host memory for the cross-vendor bridge (gloo).
//
// For CPU tensors there is nothing to stage: host() returns the tensor itself and the
// copies are skipped. For CUDA tensors the host side is pinned memory from torch's caching
// host allocator; copies run on the current stream (the backend's side stream inside a
// task), and download() blocks until the host copy is complete, because gloo reads host
// memory from the CPU. The caching host allocator records the stream of each non-blocking
// copy, so a pinned buffer is not reused while an upload from it is in flight.
#pragma once

#include <ATen/ATen.h>

#ifdef HETERO_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace hetero {

class HostStager {
 public:
  // A host tensor standing for t (t itself when t is on the CPU).
  static at::Tensor host(const at::Tensor& t) {
    if (!t.is_cuda()) {
      return t;
    }
    return at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
  }

  // device -> host; the host tensor holds the data when this returns.
  static void download(const at::Tensor& device, const at::Tensor& host) {
    if (sameMemory(device, host)) {
      return;
    }
    host.copy_(device, /*non_blocking=*/device.is_cuda());
#ifdef HETERO_WITH_CUDA
    if (device.is_cuda()) {
      c10::cuda::getCurrentCUDAStream(device.device().index()).synchronize();
    }
#endif
  }

  // host -> device, queued on the current stream.
  static void upload(const at::Tensor& host, const at::Tensor& device) {
    if (sameMemory(device, host)) {
      return;
    }
    device.copy_(host, /*non_blocking=*/device.is_cuda());
  }

  static at::Tensor toHost(const at::Tensor& t) {
    auto h = host(t);
    download(t, h);
    return h;
  }

 private:
  // On the CPU the "host" tensor is often a view of the same memory: nothing to copy.
  static bool sameMemory(const at::Tensor& a, const at::Tensor& b) {
    return a.device() == b.device() && a.data_ptr() == b.data_ptr() && a.numel() == b.numel();
  }
};

}  // namespace hetero
