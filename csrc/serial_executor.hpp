// One background thread running tasks in submission order.
//
// The hetero backend issues every inner operation of a group from one such thread, so
// the inner backends see their operations in the same order on every rank (what gloo's
// collective tags and NCCL's communicators require), whatever the caller's threads do.
// The thread starts with the first task; the destructor runs what is queued, then joins.
// Tasks must not throw. Tasks run with autograd off: communication writes tensors' memory
// as the native libraries do, and a receive buffer is often a leaf that requires grad
// (megatron-core's pipeline transfers), which autograd refuses to let copy_ write.
#pragma once

#include <c10/core/GradMode.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace hetero {

class SerialExecutor {
 public:
  SerialExecutor() = default;
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  ~SerialExecutor() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    ready_.notify_all();
    if (thread_.joinable()) {
      thread_.join();
    }
  }

  void submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!thread_.joinable()) {
        thread_ = std::thread([this] { loop(); });
      }
      queue_.push_back(std::move(task));
    }
    ready_.notify_one();
  }

 private:
  void loop() {
    c10::AutoGradMode noGrad(false);
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) {
          return;  // stopping, and nothing left to run
        }
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace hetero
