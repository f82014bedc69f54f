// The "hetero" torch.distributed backend for one process group.
//
// Python (hetero_comm) finds out which vendor each member runs on and builds the inner
// backends; this class moves the data:
// - one vendor in the group ("pass-through"): every operation goes straight to the native
//   backend for the tensor's device (NCCL/RCCL for CUDA tensors, gloo for CPU tensors),
//   on the caller's thread. (On a machine without GPUs Python does not even build this
//   class for such a group; it returns the gloo backend itself.)
// - several vendors: collectives run hierarchically (inside each vendor with the native
//   library, across vendors over a gloo bridge among one leader per vendor, staged
//   through host memory, chunked and pipelined), point-to-point goes over the native
//   group inside a vendor and over a whole-group gloo backend across vendors. Everything
//   is issued from one worker thread per group, in call order (see SerialExecutor), and
//   point-to-point completions are awaited on a second thread (the finisher).
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "hetero_work.hpp"
#include "hierarchy.hpp"
#include "serial_executor.hpp"
#include "stream_order.hpp"
#include "vendor_layout.hpp"

namespace hetero {

class HeteroBackend : public c10d::Backend {
 public:
  using BackendPtr = c10::intrusive_ptr<c10d::Backend>;
  using WorkPtr = c10::intrusive_ptr<c10d::Work>;

  using Inner = InnerBackends;

  HeteroBackend(int rank, int size, const std::vector<int64_t>& vendorOfRank, Inner inner,
                int64_t chunkBytes);
  ~HeteroBackend() override;

  const std::string getBackendName() const override { return "hetero"; }
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override;
  WorkPtr endCoalescing() override;

  const VendorLayout& layout() const { return layout_; }
  int64_t chunkBytes() const { return chunkBytes_; }
  bool passThrough() const { return passThrough_; }

  WorkPtr broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  WorkPtr allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& tensors,
                              const c10d::AllreduceCoalescedOptions& opts) override;
  WorkPtr reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                    const c10d::AllgatherOptions& opts) override;
  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input,
                          const c10d::AllgatherOptions& opts) override;
  WorkPtr allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                              std::vector<at::Tensor>& inputs,
                              const c10d::AllgatherOptions& opts) override;
  WorkPtr allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllgatherOptions& opts) override;
  WorkPtr gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                 const c10d::GatherOptions& opts) override;
  WorkPtr scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                  const c10d::ScatterOptions& opts) override;
  WorkPtr reduce_scatter(std::vector<at::Tensor>& outputs,
                         std::vector<std::vector<at::Tensor>>& inputs,
                         const c10d::ReduceScatterOptions& opts) override;
  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                               const c10d::ReduceScatterOptions& opts) override;
  WorkPtr reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::ReduceScatterOptions& opts) override;
  WorkPtr alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplits,
                        std::vector<int64_t>& inputSplits,
                        const c10d::AllToAllOptions& opts) override;
  WorkPtr alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                   const c10d::AllToAllOptions& opts) override;
  WorkPtr send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  WorkPtr recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  WorkPtr recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  WorkPtr barrier(const c10d::BarrierOptions& opts) override;
  WorkPtr allreduce_sparse(std::vector<at::Tensor>& tensors,
                           const c10d::AllreduceOptions& opts) override;

 private:
  // Point-to-point operations awaited together: one op outside a coalescing block, or
  // all ops of a batch_isend_irecv. The finisher waits for the inner works, runs the
  // copies back (staged receives) and completes the hetero works.
  struct Batch {
    c10::Device device{c10::kCPU};
    std::vector<StreamOrder::Ticket> tickets;  // the copies back wait for the callers' work
    std::vector<WorkPtr> inner;
    std::vector<std::function<void()>> afterWait;
    std::vector<c10::intrusive_ptr<HeteroWork>> works;
    std::exception_ptr error;  // set when posting failed
  };

  const BackendPtr& intraFor(const at::Tensor& t) const;
  // Pass-through: the native backend for t; inside a coalescing block, opens the device
  // backend's own coalescing group at its first CUDA operation.
  const BackendPtr& native(const at::Tensor& t);
  // Pass-through: a CPU op's work inside a coalescing block joins the block's work.
  WorkPtr track(WorkPtr work, const at::Tensor& t);

  // Runs body on the worker after the caller's pending work on the tensors; the work
  // completes (with body's exception, if any) when body returns.
  WorkPtr submit(c10d::OpType type, const std::vector<at::Tensor>& inputs,
                 std::vector<at::Tensor> outputs, std::function<void()> body);
  // One point-to-point op: post(batch) runs on the worker and adds to the batch.
  WorkPtr submitP2P(c10d::OpType type, const at::Tensor& tensor,
                    std::function<void(Batch&)> post);
  void finishBatch(std::shared_ptr<Batch> batch);
  // Opens / ends the NCCL/RCCL coalescing group of the intra-vendor device backend
  // (on the worker), for the point-to-point ops of a coalescing block.
  void openDeviceGroup(c10::Device device);
  void closeDeviceGroup();

  VendorLayout layout_;
  Inner inner_;
  int64_t chunkBytes_;
  bool passThrough_;
  Hierarchy hierarchy_;  // refers to layout_ and inner_
  StreamOrder streams_;

  // Caller-thread state of a coalescing block (batch_isend_irecv).
  bool coalescing_ = false;
  bool deviceGroupOpen_ = false;
  std::shared_ptr<Batch> batch_;

  // Declared last: destroyed first, so queued tasks finish while the rest still exists
  // (the worker hands batches to the finisher, so the worker goes first).
  SerialExecutor finisher_;
  SerialExecutor worker_;
};

}  // namespace hetero
