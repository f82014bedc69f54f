// HeteroBackend: argument checks on the caller's thread; the hierarchical algorithms
// (hierarchy.hpp) and the staged whole-group operations run on the worker.
#include "hetero_backend.hpp"

#include <torch/version.h>

#include <algorithm>

#include "host_stager.hpp"

namespace hetero {
namespace {

// torch 2.11 and older have no OpType of their own for it (GPU images often lag the pin).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 12)
constexpr auto kReduceScatterTensorCoalesced = c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED;
#else
constexpr auto kReduceScatterTensorCoalesced = c10d::OpType::COALESCED;
#endif

using WorkPtr = HeteroBackend::WorkPtr;
using Tensors = std::vector<at::Tensor>;

[[noreturn]] void unsupported(const char* op, const char* hint) {
  TORCH_CHECK(false, "hetero backend: ", op, " is not supported on a group that spans vendors; ",
              hint);
}

void checkOne(const Tensors& tensors, const char* op) {
  TORCH_CHECK(tensors.size() == 1, "hetero backend: ", op, " takes one tensor per process, got ",
              tensors.size());
}

void checkDense(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.layout() == at::kStrided, "hetero backend: ", op,
              " needs dense (strided) tensors, got layout ", t.layout());
}

void checkContiguous(const at::Tensor& t, const char* op) {
  checkDense(t, op);
  TORCH_CHECK(t.is_contiguous(), "hetero backend: ", op, " needs contiguous tensors");
}

void checkLike(const at::Tensor& t, const at::Tensor& like, const char* op) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type() && t.device() == like.device(),
              "hetero backend: ", op, " needs all tensors of one dtype and device; got ",
              t.scalar_type(), " on ", t.device(), " and ", like.scalar_type(), " on ",
              like.device());
}

// The reduction the inner backends run, and whether to divide by the group size after it
// (AVG across vendor groups of unequal sizes is SUM, then a division, as gloo does it).
struct Reduction {
  c10d::ReduceOp op;
  bool average;
};

Reduction resolve(const c10d::ReduceOp& op, const at::Tensor& t, const char* name) {
  if (op.op_ == c10d::ReduceOp::AVG) {
    TORCH_CHECK(at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()),
                "hetero backend: ", name, " with ReduceOp.AVG is not supported on ",
                t.scalar_type(), " tensors (an integer average would have to round); reduce with "
                "ReduceOp.SUM and divide");
    return {c10d::ReduceOp(c10d::ReduceOp::SUM), true};
  }
  TORCH_CHECK(op.op_ != c10d::ReduceOp::PREMUL_SUM, "hetero backend: ", name,
              " with ReduceOp.PREMUL_SUM is not supported; scale the tensor and use ReduceOp.SUM");
  return {op, false};
}

at::Tensor flatView(const at::Tensor& t) { return t.view({-1}); }

}  // namespace

HeteroBackend::HeteroBackend(int rank, int size, const std::vector<int64_t>& vendorOfRank,
                             Inner inner, int64_t chunkBytes)
    : c10d::Backend(rank, size),
      layout_(rank, vendorOfRank),
      inner_(std::move(inner)),
      chunkBytes_(std::max<int64_t>(1, chunkBytes)),
      passThrough_(layout_.numVendors() == 1),
      hierarchy_(layout_, inner_, chunkBytes_) {
  TORCH_CHECK(static_cast<int>(vendorOfRank.size()) == size, "hetero backend: ",
              vendorOfRank.size(), " vendor entries for a group of ", size);
  if (passThrough_) {
    TORCH_CHECK(inner_.hostIntra, "hetero backend: a one-vendor group needs its gloo backend");
  } else {
    TORCH_CHECK(inner_.full, "hetero backend: a group spanning vendors needs the whole-group gloo");
    TORCH_CHECK(!layout_.isLeader() || inner_.bridge,
                "hetero backend: a vendor leader needs the bridge backend");
    TORCH_CHECK(layout_.localSize() == 1 || inner_.hostIntra,
                "hetero backend: a vendor with several members needs its gloo backend");
  }
}

HeteroBackend::~HeteroBackend() = default;

// ----- helpers ---------------------------------------------------------------------------

const HeteroBackend::BackendPtr& HeteroBackend::intraFor(const at::Tensor& t) const {
  if (t.is_cuda()) {
    TORCH_CHECK(inner_.deviceIntra || (!passThrough_ && layout_.localSize() == 1),
                "hetero backend: got a CUDA tensor but this group has no NCCL/RCCL backend "
                "(torch saw no GPU when the group was created)");
    return inner_.deviceIntra;
  }
  return inner_.hostIntra;
}

const HeteroBackend::BackendPtr& HeteroBackend::native(const at::Tensor& t) {
  const auto& backend = intraFor(t);
  if (coalescing_ && t.is_cuda() && !deviceGroupOpen_) {
    backend->startCoalescing();
    deviceGroupOpen_ = true;
    batch_->device = t.device();
  }
  return backend;
}

WorkPtr HeteroBackend::track(WorkPtr work, const at::Tensor& t) {
  if (coalescing_ && !t.is_cuda() && work) {
    batch_->inner.push_back(work);
  }
  return work;
}

WorkPtr HeteroBackend::submit(c10d::OpType type, const Tensors& inputs, Tensors outputs,
                              std::function<void()> body) {
  closeDeviceGroup();
  Tensors all(inputs);
  all.insert(all.end(), outputs.begin(), outputs.end());
  auto ticket = streams_.capture(all);
  auto work = c10::make_intrusive<HeteroWork>(getRank(), type, std::move(outputs), ticket.device);
  worker_.submit([this, work, ticket, body = std::move(body)] {
    std::exception_ptr error;
    StreamOrder::Scope scope(streams_, ticket, StreamOrder::Lane::kWorker);
    try {
      body();
    } catch (...) {
      error = std::current_exception();
    }
    work->complete(error);
  });
  return work;
}

WorkPtr HeteroBackend::submitP2P(c10d::OpType type, const at::Tensor& tensor,
                                 std::function<void(Batch&)> post) {
  auto ticket = streams_.capture({tensor});
  auto work = c10::make_intrusive<HeteroWork>(getRank(), type, Tensors{tensor}, ticket.device);
  const bool single = !coalescing_;
  auto batch = single ? std::make_shared<Batch>() : batch_;
  if (ticket.device.is_cuda()) {
    batch->device = ticket.device;
  }
  batch->tickets.push_back(ticket);
  batch->works.push_back(work);
  worker_.submit([this, batch, ticket, single, post = std::move(post)] {
    StreamOrder::Scope scope(streams_, ticket, StreamOrder::Lane::kWorker);
    try {
      post(*batch);
    } catch (...) {
      batch->error = std::current_exception();
    }
    if (single) {
      finishBatch(batch);
    }
  });
  return work;
}

void HeteroBackend::finishBatch(std::shared_ptr<Batch> batch) {
  finisher_.submit([this, batch] {
    StreamOrder::Scope scope(streams_, batch->device, StreamOrder::Lane::kFinisher);
    for (const auto& ticket : batch->tickets) {
      scope.after(ticket);
    }
    std::exception_ptr error = batch->error;
    if (!error) {
      try {
        for (auto& work : batch->inner) {
          if (work) {
            work->wait();
          }
        }
        for (auto& copyBack : batch->afterWait) {
          copyBack();
        }
      } catch (...) {
        error = std::current_exception();
      }
    }
    for (auto& work : batch->works) {
      work->complete(error);
    }
  });
}

void HeteroBackend::openDeviceGroup(c10::Device device) {
  deviceGroupOpen_ = true;
  auto batch = batch_;
  worker_.submit([this, batch, device] {
    StreamOrder::Scope scope(streams_, device, StreamOrder::Lane::kWorker);
    try {
      inner_.deviceIntra->startCoalescing();
    } catch (...) {
      batch->error = std::current_exception();
    }
  });
}

void HeteroBackend::closeDeviceGroup() {
  if (!deviceGroupOpen_ || passThrough_) {
    return;
  }
  deviceGroupOpen_ = false;
  auto batch = batch_;
  worker_.submit([this, batch] {
    StreamOrder::Scope scope(streams_, batch->device, StreamOrder::Lane::kWorker);
    try {
      batch->inner.push_back(inner_.deviceIntra->endCoalescing());
    } catch (...) {
      batch->error = std::current_exception();
    }
  });
}

// ----- coalescing (batch_isend_irecv, coalescing manager) ----------------------------------

void HeteroBackend::startCoalescing() {
  TORCH_CHECK(!coalescing_, "hetero backend: startCoalescing twice without endCoalescing");
  coalescing_ = true;
  batch_ = std::make_shared<Batch>();
}

WorkPtr HeteroBackend::endCoalescing() {
  TORCH_CHECK(coalescing_, "hetero backend: endCoalescing without startCoalescing");
  if (passThrough_) {
    coalescing_ = false;
    auto batch = std::move(batch_);
    WorkPtr deviceWork;
    if (deviceGroupOpen_) {
      deviceGroupOpen_ = false;
      deviceWork = inner_.deviceIntra->endCoalescing();
      if (batch->inner.empty() && deviceWork) {
        return deviceWork;  // only NCCL/RCCL operations: their own work, no overhead
      }
      batch->inner.push_back(deviceWork);
    }
    auto work = c10::make_intrusive<HeteroWork>(getRank(), c10d::OpType::COALESCED, Tensors{},
                                                batch->device);
    batch->works.push_back(work);
    finishBatch(batch);
    return work;
  }
  closeDeviceGroup();
  coalescing_ = false;
  auto batch = std::move(batch_);
  auto work = c10::make_intrusive<HeteroWork>(getRank(), c10d::OpType::COALESCED, Tensors{},
                                              batch->device);
  batch->works.push_back(work);
  // Through the worker, so the batch is finished after everything posted before it.
  worker_.submit([this, batch] { finishBatch(batch); });
  return work;
}

// ----- point-to-point ----------------------------------------------------------------------

WorkPtr HeteroBackend::send(Tensors& tensors, int dstRank, int tag) {
  checkOne(tensors, "send");
  if (passThrough_) {
    return track(native(tensors[0])->send(tensors, dstRank, tag), tensors[0]);
  }
  const at::Tensor t = tensors[0];
  checkContiguous(t, "send");
  const bool sameVendor = layout_.vendorOf(dstRank) == layout_.myVendor();
  if (coalescing_ && sameVendor && t.is_cuda() && !deviceGroupOpen_) {
    openDeviceGroup(t.device());
  }
  return submitP2P(c10d::OpType::SEND, t, [this, t, dstRank, tag, sameVendor](Batch& batch) {
    if (sameVendor) {
      Tensors v{t};
      batch.inner.push_back(intraFor(t)->send(v, layout_.localRank(dstRank), tag));
    } else {
      Tensors v{HostStager::toHost(t)};
      batch.inner.push_back(inner_.full->send(v, dstRank, tag));
    }
  });
}

WorkPtr HeteroBackend::recv(Tensors& tensors, int srcRank, int tag) {
  checkOne(tensors, "recv");
  if (passThrough_) {
    return track(native(tensors[0])->recv(tensors, srcRank, tag), tensors[0]);
  }
  const at::Tensor t = tensors[0];
  checkContiguous(t, "recv");
  const bool sameVendor = layout_.vendorOf(srcRank) == layout_.myVendor();
  if (coalescing_ && sameVendor && t.is_cuda() && !deviceGroupOpen_) {
    openDeviceGroup(t.device());
  }
  return submitP2P(c10d::OpType::RECV, t, [this, t, srcRank, tag, sameVendor](Batch& batch) {
    if (sameVendor) {
      Tensors v{t};
      batch.inner.push_back(intraFor(t)->recv(v, layout_.localRank(srcRank), tag));
    } else {
      auto host = HostStager::host(t);
      Tensors v{host};
      batch.inner.push_back(inner_.full->recv(v, srcRank, tag));
      if (!host.is_same(t)) {
        batch.afterWait.push_back([host, t] { HostStager::upload(host, t); });
      }
    }
  });
}

WorkPtr HeteroBackend::recvAnysource(Tensors& tensors, int tag) {
  if (passThrough_) {
    checkOne(tensors, "recv");
    return track(native(tensors[0])->recvAnysource(tensors, tag), tensors[0]);
  }
  unsupported("recv from any source (recv without src)", "give the source rank");
}

// ----- reductions --------------------------------------------------------------------------

WorkPtr HeteroBackend::allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) {
  checkOne(tensors, "allreduce");
  if (passThrough_) {
    return track(native(tensors[0])->allreduce(tensors, opts), tensors[0]);
  }
  const at::Tensor t = tensors[0];
  checkDense(t, "allreduce");
  const auto red = resolve(opts.reduceOp, t, "allreduce");
  return submit(c10d::OpType::ALLREDUCE, {t}, {t}, [this, t, red] {
    auto buffer = t.contiguous();
    hierarchy_.allreduce(flatView(buffer), red.op, red.average);
    if (!buffer.is_same(t)) {
      t.copy_(buffer);
    }
  });
}

WorkPtr HeteroBackend::allreduce_coalesced(Tensors& tensors,
                                           const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "hetero backend: allreduce_coalesced of no tensors");
  if (passThrough_) {
    return track(native(tensors[0])->allreduce_coalesced(tensors, opts), tensors[0]);
  }
  for (const auto& t : tensors) {
    checkDense(t, "allreduce_coalesced");
    checkLike(t, tensors[0], "allreduce_coalesced");
  }
  const auto red = resolve(opts.reduceOp, tensors[0], "allreduce_coalesced");
  return submit(c10d::OpType::ALLREDUCE_COALESCED, tensors, tensors, [this, tensors, red] {
    Tensors flats;
    for (const auto& t : tensors) {
      flats.push_back(t.reshape({-1}));
    }
    auto flat = at::cat(flats);
    hierarchy_.allreduce(flat, red.op, red.average);
    int64_t offset = 0;
    for (const auto& t : tensors) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  });
}

WorkPtr HeteroBackend::reduce(Tensors& tensors, const c10d::ReduceOptions& opts) {
  checkOne(tensors, "reduce");
  if (passThrough_) {
    return track(native(tensors[0])->reduce(tensors, opts), tensors[0]);
  }
  const at::Tensor t = tensors[0];
  checkDense(t, "reduce");
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < getSize(), "hetero backend: reduce root ", root,
              " outside a group of ", getSize());
  const auto red = resolve(opts.reduceOp, t, "reduce");
  return submit(c10d::OpType::REDUCE, {t}, {t}, [this, t, red, root] {
    auto buffer = t.contiguous();
    hierarchy_.reduce(flatView(buffer), red.op, red.average, root);
    if (!buffer.is_same(t)) {
      t.copy_(buffer);
    }
  });
}



// ----- broadcast -----------------------------------------------------------------------------

WorkPtr HeteroBackend::broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) {
  checkOne(tensors, "broadcast");
  if (passThrough_) {
    return track(native(tensors[0])->broadcast(tensors, opts), tensors[0]);
  }
  const at::Tensor t = tensors[0];
  checkDense(t, "broadcast");
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < getSize(), "hetero backend: broadcast root ", root,
              " outside a group of ", getSize());
  return submit(c10d::OpType::BROADCAST, {t}, {t}, [this, t, root] {
    auto buffer = t.contiguous();
    hierarchy_.broadcast(flatView(buffer), root);
    if (!buffer.is_same(t)) {
      t.copy_(buffer);
    }
  });
}



// ----- allgather -----------------------------------------------------------------------------

WorkPtr HeteroBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                       const c10d::AllgatherOptions& opts) {
  if (passThrough_) {
    return track(native(input)->_allgather_base(output, input, opts), input);
  }
  checkContiguous(input, "all_gather_into_tensor");
  checkContiguous(output, "all_gather_into_tensor");
  checkLike(output, input, "all_gather_into_tensor");
  TORCH_CHECK(output.numel() == input.numel() * getSize(), "hetero backend: "
              "all_gather_into_tensor needs an output of group size x input elements");
  const at::Tensor in = input, out = output;
  return submit(c10d::OpType::_ALLGATHER_BASE, {in}, {out},
                [this, in, out] { hierarchy_.allgather(flatView(in), flatView(out)); });
}

WorkPtr HeteroBackend::allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                                       const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(!inputs.empty(), "hetero backend: allgather_into_tensor_coalesced of no tensors");
  if (passThrough_) {
    return track(native(inputs[0])->allgather_into_tensor_coalesced(outputs, inputs, opts),
                 inputs[0]);
  }
  TORCH_CHECK(outputs.size() == inputs.size(), "hetero backend: "
              "allgather_into_tensor_coalesced needs one output per input");
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkContiguous(inputs[i], "allgather_into_tensor_coalesced");
    checkContiguous(outputs[i], "allgather_into_tensor_coalesced");
    checkLike(outputs[i], inputs[i], "allgather_into_tensor_coalesced");
    checkLike(inputs[i], inputs[0], "allgather_into_tensor_coalesced");
    TORCH_CHECK(outputs[i].numel() == inputs[i].numel() * getSize(), "hetero backend: "
                "allgather_into_tensor_coalesced needs outputs of group size x input elements");
  }
  return submit(c10d::OpType::COALESCED, inputs, outputs, [this, inputs, outputs] {
    for (size_t i = 0; i < inputs.size(); ++i) {
      hierarchy_.allgather(flatView(inputs[i]), flatView(outputs[i]));
    }
  });
}

WorkPtr HeteroBackend::allgather(std::vector<Tensors>& outputs, Tensors& inputs,
                                 const c10d::AllgatherOptions& opts) {
  checkOne(inputs, "allgather");
  if (passThrough_) {
    return track(native(inputs[0])->allgather(outputs, inputs, opts), inputs[0]);
  }
  const at::Tensor in = inputs[0];
  checkDense(in, "allgather");
  TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
              "hetero backend: allgather needs one list of group size output tensors");
  const Tensors outs = outputs[0];
  for (const auto& o : outs) {
    checkDense(o, "allgather");
    checkLike(o, in, "allgather");
    TORCH_CHECK(o.numel() == in.numel(), "hetero backend: allgather outputs must match the input");
  }
  return submit(c10d::OpType::ALLGATHER, {in}, outs, [this, in, outs] {
    const int64_t n = in.numel();
    auto flatIn = in.reshape({-1});
    auto gathered = at::empty({n * getSize()}, flatIn.options());
    hierarchy_.allgather(flatIn, gathered);
    for (int r = 0; r < getSize(); ++r) {
      outs[r].copy_(gathered.narrow(0, r * n, n).view(outs[r].sizes()));
    }
  });
}


WorkPtr HeteroBackend::allgather_coalesced(std::vector<Tensors>& outputs, Tensors& inputs,
                                           const c10d::AllgatherOptions& opts) {
  if (passThrough_ && !inputs.empty()) {
    return track(native(inputs[0])->allgather_coalesced(outputs, inputs, opts), inputs[0]);
  }
  unsupported("allgather_coalesced (all_gather_coalesced, deprecated by torch)",
              "use all_gather_into_tensor or all_gather per tensor");
}

// ----- reduce-scatter ------------------------------------------------------------------------

WorkPtr HeteroBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                            const c10d::ReduceScatterOptions& opts) {
  if (passThrough_) {
    return track(native(input)->_reduce_scatter_base(output, input, opts), input);
  }
  checkContiguous(input, "reduce_scatter_tensor");
  checkContiguous(output, "reduce_scatter_tensor");
  checkLike(output, input, "reduce_scatter_tensor");
  TORCH_CHECK(input.numel() == output.numel() * getSize(), "hetero backend: "
              "reduce_scatter_tensor needs an input of group size x output elements");
  const auto red = resolve(opts.reduceOp, input, "reduce_scatter_tensor");
  const at::Tensor in = input, out = output;
  return submit(c10d::OpType::_REDUCE_SCATTER_BASE, {in}, {out}, [this, in, out, red] {
    hierarchy_.reduceScatter(flatView(in), flatView(out), red.op, red.average);
  });
}

WorkPtr HeteroBackend::reduce_scatter_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                                       const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(!inputs.empty(), "hetero backend: reduce_scatter_tensor_coalesced of no tensors");
  if (passThrough_) {
    return track(native(inputs[0])->reduce_scatter_tensor_coalesced(outputs, inputs, opts),
                 inputs[0]);
  }
  TORCH_CHECK(outputs.size() == inputs.size(), "hetero backend: "
              "reduce_scatter_tensor_coalesced needs one output per input");
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkContiguous(inputs[i], "reduce_scatter_tensor_coalesced");
    checkContiguous(outputs[i], "reduce_scatter_tensor_coalesced");
    checkLike(outputs[i], inputs[i], "reduce_scatter_tensor_coalesced");
    checkLike(inputs[i], inputs[0], "reduce_scatter_tensor_coalesced");
    TORCH_CHECK(inputs[i].numel() == outputs[i].numel() * getSize(), "hetero backend: "
                "reduce_scatter_tensor_coalesced needs inputs of group size x output elements");
  }
  const auto red = resolve(opts.reduceOp, inputs[0], "reduce_scatter_tensor_coalesced");
  return submit(kReduceScatterTensorCoalesced, inputs, outputs,
                [this, inputs, outputs, red] {
                  for (size_t i = 0; i < inputs.size(); ++i) {
                    hierarchy_.reduceScatter(flatView(inputs[i]), flatView(outputs[i]), red.op,
                                      red.average);
                  }
                });
}

WorkPtr HeteroBackend::reduce_scatter(Tensors& outputs, std::vector<Tensors>& inputs,
                                      const c10d::ReduceScatterOptions& opts) {
  checkOne(outputs, "reduce_scatter");
  if (passThrough_) {
    return track(native(outputs[0])->reduce_scatter(outputs, inputs, opts), outputs[0]);
  }
  const at::Tensor out = outputs[0];
  checkContiguous(out, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
              "hetero backend: reduce_scatter needs one list of group size input tensors");
  const Tensors ins = inputs[0];
  for (const auto& t : ins) {
    checkDense(t, "reduce_scatter");
    checkLike(t, out, "reduce_scatter");
    TORCH_CHECK(t.numel() == out.numel(), "hetero backend: reduce_scatter inputs must match "
                "the output");
  }
  const auto red = resolve(opts.reduceOp, out, "reduce_scatter");
  return submit(c10d::OpType::REDUCE_SCATTER, ins, {out}, [this, ins, out, red] {
    Tensors flats;
    for (const auto& t : ins) {
      flats.push_back(t.reshape({-1}));
    }
    hierarchy_.reduceScatter(at::cat(flats), flatView(out), red.op, red.average);
  });
}


// ----- whole-group operations over gloo (host memory) ---------------------------------------

WorkPtr HeteroBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                     std::vector<int64_t>& outputSplits,
                                     std::vector<int64_t>& inputSplits,
                                     const c10d::AllToAllOptions& opts) {
  if (passThrough_) {
    return track(native(input)->alltoall_base(output, input, outputSplits, inputSplits, opts),
                 input);
  }
  checkContiguous(input, "all_to_all_single");
  checkContiguous(output, "all_to_all_single");
  checkLike(output, input, "all_to_all_single");
  const at::Tensor in = input, out = output;
  return submit(c10d::OpType::ALLTOALL_BASE, {in}, {out},
                [this, in, out, outputSplits, inputSplits] {
                  auto inHost = HostStager::toHost(in);
                  auto outHost = HostStager::host(out);
                  auto outSplits = outputSplits;
                  auto inSplits = inputSplits;
                  inner_.full->alltoall_base(outHost, inHost, outSplits, inSplits)->wait();
                  HostStager::upload(outHost, out);
                });
}

WorkPtr HeteroBackend::alltoall(Tensors& outputs, Tensors& inputs,
                                const c10d::AllToAllOptions& opts) {
  TORCH_CHECK(!inputs.empty(), "hetero backend: all_to_all of no tensors");
  if (passThrough_) {
    return track(native(inputs[0])->alltoall(outputs, inputs, opts), inputs[0]);
  }
  for (const auto& t : inputs) {
    checkContiguous(t, "all_to_all");
    checkLike(t, inputs[0], "all_to_all");
  }
  for (const auto& t : outputs) {
    checkContiguous(t, "all_to_all");
    checkLike(t, inputs[0], "all_to_all");
  }
  // One all_to_all_single over the concatenated blocks, so blocks may differ in size.
  return submit(c10d::OpType::ALLTOALL, inputs, outputs, [this, inputs, outputs] {
    Tensors flats;
    std::vector<int64_t> inSplits, outSplits;
    for (const auto& t : inputs) {
      flats.push_back(t.reshape({-1}));
      inSplits.push_back(t.numel());
    }
    int64_t total = 0;
    for (const auto& t : outputs) {
      outSplits.push_back(t.numel());
      total += t.numel();
    }
    auto inHost = HostStager::toHost(at::cat(flats));
    auto outHost = at::empty({total}, inHost.options());
    inner_.full->alltoall_base(outHost, inHost, outSplits, inSplits)->wait();
    int64_t offset = 0;
    for (const auto& t : outputs) {
      t.copy_(outHost.narrow(0, offset, t.numel()).view(t.sizes()), /*non_blocking=*/true);
      offset += t.numel();
    }
  });
}

WorkPtr HeteroBackend::gather(std::vector<Tensors>& outputs, Tensors& inputs,
                              const c10d::GatherOptions& opts) {
  checkOne(inputs, "gather");
  if (passThrough_) {
    return track(native(inputs[0])->gather(outputs, inputs, opts), inputs[0]);
  }
  const at::Tensor in = inputs[0];
  checkContiguous(in, "gather");
  const int root = static_cast<int>(opts.rootRank);
  const bool isRoot = getRank() == root;
  Tensors outs;
  if (isRoot) {
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
                "hetero backend: gather needs one list of group size outputs on the root");
    outs = outputs[0];
    for (const auto& t : outs) {
      checkContiguous(t, "gather");
      checkLike(t, in, "gather");
    }
  }
  return submit(c10d::OpType::GATHER, {in}, outs, [this, in, outs, root, isRoot] {
    Tensors inHost{HostStager::toHost(in)};
    std::vector<Tensors> outHost;
    if (isRoot) {
      outHost.emplace_back();
      for (const auto& t : outs) {
        outHost[0].push_back(HostStager::host(t));
      }
    }
    c10d::GatherOptions o;
    o.rootRank = root;
    inner_.full->gather(outHost, inHost, o)->wait();
    for (size_t i = 0; i < outs.size(); ++i) {
      HostStager::upload(outHost[0][i], outs[i]);
    }
  });
}

WorkPtr HeteroBackend::scatter(Tensors& outputs, std::vector<Tensors>& inputs,
                               const c10d::ScatterOptions& opts) {
  checkOne(outputs, "scatter");
  if (passThrough_) {
    return track(native(outputs[0])->scatter(outputs, inputs, opts), outputs[0]);
  }
  const at::Tensor out = outputs[0];
  checkContiguous(out, "scatter");
  const int root = static_cast<int>(opts.rootRank);
  const bool isRoot = getRank() == root;
  Tensors ins;
  if (isRoot) {
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
                "hetero backend: scatter needs one list of group size inputs on the root");
    ins = inputs[0];
    for (const auto& t : ins) {
      checkContiguous(t, "scatter");
      checkLike(t, out, "scatter");
    }
  }
  return submit(c10d::OpType::SCATTER, ins, {out}, [this, ins, out, root, isRoot] {
    std::vector<Tensors> inHost;
    if (isRoot) {
      inHost.emplace_back();
      for (const auto& t : ins) {
        inHost[0].push_back(HostStager::toHost(t));
      }
    }
    auto outHost = HostStager::host(out);
    Tensors outs{outHost};
    c10d::ScatterOptions o;
    o.rootRank = root;
    inner_.full->scatter(outs, inHost, o)->wait();
    HostStager::upload(outHost, out);
  });
}

WorkPtr HeteroBackend::barrier(const c10d::BarrierOptions& opts) {
  if (passThrough_) {
    const bool onDevice = inner_.deviceIntra && ((opts.device && opts.device->is_cuda()) ||
                                                 (!opts.device && !opts.device_ids.empty()));
    return (onDevice ? inner_.deviceIntra : inner_.hostIntra)->barrier(opts);
  }
  // After every operation issued to this group before it (the worker runs in order).
  return submit(c10d::OpType::BARRIER, {}, {},
                [this] { inner_.full->barrier(c10d::BarrierOptions())->wait(); });
}

WorkPtr HeteroBackend::allreduce_sparse(Tensors& tensors, const c10d::AllreduceOptions& opts) {
  if (passThrough_ && tensors.size() == 1) {
    return track(native(tensors[0])->allreduce_sparse(tensors, opts), tensors[0]);
  }
  unsupported("allreduce of sparse tensors", "densify the tensor first");
}

}  // namespace hetero
