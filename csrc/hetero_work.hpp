// The Work the hetero backend returns for an operation it runs on its own threads.
//
// complete() is called once, by the thread that finished the operation; for CUDA
// operations that thread has the backend's side stream current, and complete() records a
// done event on it. wait() blocks until complete() and then makes the caller's current
// stream wait for the done event (like NCCL's Work, it does not wait for the GPU itself).
// The future holds the output tensors (DDP comm hooks read get_future().wait()[0]); it is
// a CUDA-aware c10 Future, so waiting on it also orders the caller's stream.
#pragma once

#include <chrono>
#include <exception>
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#ifdef HETERO_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace hetero {

class HeteroWork : public c10d::Work {
 public:
  HeteroWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, c10::Device device)
      : c10d::Work(rank, type), outputs_(std::move(outputs)), device_(device) {
    std::vector<c10::Device> devices;
    if (device_.is_cuda()) {
      devices.push_back(device_);
    }
    future_ = c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()), std::move(devices));
  }

  void complete(std::exception_ptr error = nullptr) {
#ifdef HETERO_WITH_CUDA
    if (device_.is_cuda() && !error) {
      done_ = std::make_unique<at::cuda::CUDAEvent>();
      done_->record(c10::cuda::getCurrentCUDAStream(device_.index()));
    }
#endif
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
    finish(error);
  }

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (timeout == kNoTimeout) {
        cv_.wait(lock, [this] { return completed_; });
      } else if (!cv_.wait_for(lock, timeout, [this] { return completed_; })) {
        TORCH_CHECK(false, "hetero backend: operation timed out after ", timeout.count(), " ms");
      }
      if (exception_) {
        std::rethrow_exception(exception_);
      }
    }
    synchronize();
    return true;
  }

  void synchronize() override {
#ifdef HETERO_WITH_CUDA
    if (done_) {
      done_->block(c10::cuda::getCurrentCUDAStream(device_.index()));
    }
#endif
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  std::vector<at::Tensor> result() override { return outputs_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::Device device_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
#ifdef HETERO_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAEvent> done_;
#endif
};

}  // namespace hetero
