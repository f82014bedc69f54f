// CUDA stream semantics of the hetero backend; every method is a no-op for CPU tensors.
//
// The device work the backend does itself for a group (staging copies to and from host
// memory, averaging) runs on side streams, one per device and lane: the worker lane
// (collectives, posting point-to-point ops) and the finisher lane (copies back after
// point-to-point receives), so waiting for a receive never delays the collectives. The
// inner backends are called while a side stream is current, so NCCL/RCCL order their
// kernels after it:
// - at submission (caller thread) an event is recorded on the caller's current stream and
//   the tensors are recordStream'ed on the side streams (the caching allocator keeps them
//   until the side streams are done with them even if the caller frees them);
// - a task first makes its side stream wait for that event (Scope);
// - the task ends by recording a done event on its side stream, which Work::wait() makes
//   the caller's current stream wait for (see HeteroWork).
#pragma once

#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>

#ifdef HETERO_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace hetero {

class StreamOrder {
 public:
  enum class Lane { kWorker = 0, kFinisher = 1 };

  // What a task needs to start after the caller's pending work on its tensors.
  struct Ticket {
    c10::Device device{c10::kCPU};
#ifdef HETERO_WITH_CUDA
    std::shared_ptr<at::cuda::CUDAEvent> ready;
#endif
  };

  // The device an operation runs on: the first CUDA tensor's, else the CPU.
  static c10::Device deviceOf(const std::vector<at::Tensor>& tensors) {
    for (const auto& t : tensors) {
      if (t.defined() && t.is_cuda()) {
        return t.device();
      }
    }
    return c10::Device(c10::kCPU);
  }

  // Caller thread, when an operation is submitted.
  Ticket capture(const std::vector<at::Tensor>& tensors) {
    Ticket ticket;
    ticket.device = deviceOf(tensors);
    if (!ticket.device.is_cuda()) {
      return ticket;
    }
#ifdef HETERO_WITH_CUDA
    const auto index = ticket.device.index();
    ticket.ready = std::make_shared<at::cuda::CUDAEvent>();
    ticket.ready->record(c10::cuda::getCurrentCUDAStream(index));
    for (auto lane : {Lane::kWorker, Lane::kFinisher}) {
      auto side = stream(index, lane);
      for (const auto& t : tensors) {
        if (t.defined() && t.is_cuda()) {
          c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), side);
        }
      }
    }
#else
    TORCH_CHECK(false,
                "hetero backend: this build of hetero_comm._comm_ext has no CUDA support; rebuild it "
                "against a CUDA or ROCm torch with the toolkit installed "
                "(pip install --no-build-isolation -e .)");
#endif
    return ticket;
  }

  // Inside a task: makes the side stream of a device and lane current (restored at the
  // end of the scope); after() makes it wait for the caller's work of a ticket.
  class Scope {
   public:
    Scope(StreamOrder& order, c10::Device device, Lane lane) {
#ifdef HETERO_WITH_CUDA
      if (device.is_cuda()) {
        guard_.emplace(order.stream(device.index(), lane));
      }
#else
      (void)order;
      (void)device;
      (void)lane;
#endif
    }

    Scope(StreamOrder& order, const Ticket& ticket, Lane lane)
        : Scope(order, ticket.device, lane) {
      after(ticket);
    }

    void after(const Ticket& ticket) {
#ifdef HETERO_WITH_CUDA
      if (ticket.ready && guard_) {
        ticket.ready->block(guard_->current_stream());
      }
#else
      (void)ticket;
#endif
    }

   private:
#ifdef HETERO_WITH_CUDA
    std::optional<c10::cuda::CUDAStreamGuard> guard_;
#endif
  };

 private:
#ifdef HETERO_WITH_CUDA
  c10::cuda::CUDAStream stream(c10::DeviceIndex index, Lane lane) {
    const int key = static_cast<int>(index) * 2 + static_cast<int>(lane);
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = streams_.find(key);
    if (found == streams_.end()) {
      found = streams_.emplace(key, c10::cuda::getStreamFromPool(false, index)).first;
    }
    return found->second;
  }

  std::mutex mutex_;
  std::unordered_map<int, c10::cuda::CUDAStream> streams_;
#endif
};

}  // namespace hetero
