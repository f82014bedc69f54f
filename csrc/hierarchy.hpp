// The hierarchical collectives of a group that spans vendors.
//
// Inside a vendor the native library (the vendor's inner backend for the tensor's
// device), across vendors a gloo bridge among the vendor leaders, staged through host
// memory, chunked and pipelined (ChunkPipeline). Runs on the backend's worker thread, on
// 1-D contiguous tensors; every member of the group calls the same method in the same
// order. README.md describes each algorithm.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "chunk_pipeline.hpp"
#include "host_stager.hpp"
#include "vendor_layout.hpp"

namespace hetero {

// The native backends a HeteroBackend drives, built by Python over PrefixStores of the
// group's store. Null where not needed: a vendor with one member has no inner groups,
// only leaders have a bridge, a one-vendor group has neither bridge nor whole-group gloo.
struct InnerBackends {
  using Ptr = c10::intrusive_ptr<c10d::Backend>;
  Ptr hostIntra;    // gloo over the members of this rank's vendor (all, if one vendor)
  Ptr deviceIntra;  // NCCL/RCCL over the same ranks; null without GPUs
  Ptr bridge;       // gloo over the vendor leaders, bridge rank = vendor number
  Ptr full;         // gloo over the whole group: cross-vendor p2p, alltoall, barrier
};

class Hierarchy {
 public:
  using Tensors = std::vector<at::Tensor>;
  using WorkPtr = c10::intrusive_ptr<c10d::Work>;

  Hierarchy(const VendorLayout& layout, const InnerBackends& inner, int64_t chunkBytes)
      : layout_(layout), inner_(inner), chunkBytes_(chunkBytes) {}

  // The vendor's inner backend for t's device (null for a one-member vendor).
  const InnerBackends::Ptr& intraFor(const at::Tensor& t) const {
    if (t.is_cuda()) {
      TORCH_CHECK(inner_.deviceIntra || layout_.localSize() == 1,
                  "hetero backend: got a CUDA tensor but this group has no NCCL/RCCL backend "
                  "(torch saw no GPU when the group was created)");
      return inner_.deviceIntra;
    }
    return inner_.hostIntra;
  }

  // Per chunk: intra reduce to the leader, bridge allreduce, intra broadcast.
  void allreduce(const at::Tensor& flat, const c10d::ReduceOp& op, bool average) {
    const auto& intra = intraFor(flat);
    std::vector<Piece> pieces;
    ChunkPipeline::split(pieces, 0, flat.numel(), elementsPerChunk(flat));
    auto chunk = [&](size_t i) { return flat.narrow(0, pieces[i].offset, pieces[i].length); };
    ChunkSteps steps;
    if (intra) {
      steps.pre = [&](size_t i) { return reduceToLeader(intra, chunk(i), op); };
      steps.post = [&](size_t i) { return broadcastInVendor(intra, chunk(i), 0); };
    }
    steps.bridge = [&](size_t i) {
      auto c = chunk(i);
      auto host = HostStager::toHost(c);
      Tensors v{host};
      c10d::AllreduceOptions o;
      o.reduceOp = op;
      inner_.bridge->allreduce(v, o)->wait();
      HostStager::upload(host, c);
    };
    ChunkPipeline::run(pieces.size(), layout_.isLeader(), steps);
    if (average) {
      flat.div_(layout_.size());
    }
  }

  // Per chunk: intra reduce, bridge reduce to the root's vendor, leader -> root.
  void reduce(const at::Tensor& flat, const c10d::ReduceOp& op, bool average,
                                 int root) {
    const auto& intra = intraFor(flat);
    const int rootVendor = layout_.vendorOf(root);
    const bool rootsVendor = rootVendor == layout_.myVendor();
    std::vector<Piece> pieces;
    ChunkPipeline::split(pieces, 0, flat.numel(), elementsPerChunk(flat));
    auto chunk = [&](size_t i) { return flat.narrow(0, pieces[i].offset, pieces[i].length); };
    ChunkSteps steps;
    if (intra) {
      steps.pre = [&](size_t i) { return reduceToLeader(intra, chunk(i), op); };
    }
    steps.bridge = [&](size_t i) { bridgeReduce(chunk(i), op, rootVendor); };
    // The root's vendor leader holds the result; hand it to the root if that is another rank.
    if (intra && rootsVendor && root != layout_.leaderOf(rootVendor)) {
      if (layout_.isLeader()) {
        steps.post = [&](size_t i) {
          Tensors v{chunk(i)};
          return intra->send(v, layout_.localRank(root), static_cast<int>(i));
        };
      } else if (layout_.rank() == root) {
        steps.post = [&](size_t i) {
          Tensors v{chunk(i)};
          return intra->recv(v, 0, static_cast<int>(i));
        };
      }
    }
    ChunkPipeline::run(pieces.size(), layout_.isLeader(), steps);
    if (average && layout_.rank() == root) {
      flat.div_(layout_.size());
    }
  }

  // Per chunk: intra broadcast in the root's vendor, bridge broadcast, intra broadcast.
  void broadcast(const at::Tensor& flat, int root) {
    const auto& intra = intraFor(flat);
    const int rootVendor = layout_.vendorOf(root);
    const bool rootsVendor = rootVendor == layout_.myVendor();
    std::vector<Piece> pieces;
    ChunkPipeline::split(pieces, 0, flat.numel(), elementsPerChunk(flat));
    auto chunk = [&](size_t i) { return flat.narrow(0, pieces[i].offset, pieces[i].length); };
    ChunkSteps steps;
    if (intra && rootsVendor) {  // root -> its vendor (the leader included)
      steps.pre = [&](size_t i) { return broadcastInVendor(intra, chunk(i), layout_.localRank(root)); };
    } else if (intra) {  // leader -> its vendor, after the bridge
      steps.post = [&](size_t i) { return broadcastInVendor(intra, chunk(i), 0); };
    }
    steps.bridge = [&](size_t i) {
      auto c = chunk(i);
      auto host = rootsVendor ? HostStager::toHost(c) : HostStager::host(c);
      Tensors v{host};
      c10d::BroadcastOptions o;
      o.rootRank = rootVendor;
      inner_.bridge->broadcast(v, o)->wait();
      if (!rootsVendor) {
        HostStager::upload(host, c);
      }
    };
    ChunkPipeline::run(pieces.size(), layout_.isLeader(), steps);
  }

  // Intra gather to the leader, bridge broadcasts of the vendor slices, intra broadcast.
  void allgather(const at::Tensor& in, const at::Tensor& out) {
    const int64_t n = in.numel();
    if (n == 0) {
      return;
    }
    const auto& intra = intraFor(in);
    const int me = layout_.myVendor();
    // Blocks in vendor order, so that each vendor's blocks are one contiguous slice.
    const bool direct = layout_.rankOrderIsVendorOrder();
    const at::Tensor order = direct ? out : at::empty({out.numel()}, out.options());
    auto slice = [&](const at::Tensor& buffer, int vendor) {
      return buffer.narrow(0, layout_.firstSlot(vendor) * n, layout_.numMembers(vendor) * n);
    };
    const at::Tensor mine = slice(order, me);

    // 1. the vendor's inputs to its leader
    if (intra) {
      std::vector<Tensors> outs;
      if (layout_.isLeader()) {
        outs.emplace_back();
        for (int k = 0; k < layout_.localSize(); ++k) {
          outs[0].push_back(mine.narrow(0, k * n, n));
        }
      }
      Tensors ins{in};
      c10d::GatherOptions o;
      o.rootRank = 0;
      intra->gather(outs, ins, o)->wait();
    } else {
      mine.copy_(in);
    }
    // 2. leaders exchange their vendors' slices over the bridge
    if (layout_.isLeader()) {
      const auto host = HostStager::host(order);
      HostStager::download(mine, slice(host, me));
      std::vector<WorkPtr> works;
      for (int v = 0; v < layout_.numVendors(); ++v) {
        Tensors t{slice(host, v)};
        c10d::BroadcastOptions o;
        o.rootRank = v;
        works.push_back(inner_.bridge->broadcast(t, o));
      }
      for (auto& work : works) {
        work->wait();
      }
      for (int v = 0; v < layout_.numVendors(); ++v) {
        if (v != me) {
          HostStager::upload(slice(host, v), slice(order, v));
        }
      }
    }
    // 3. the whole result from the leader to its vendor
    broadcastFromLeader(order);
    // 4. back to rank order
    if (!direct) {
      for (int r = 0; r < layout_.size(); ++r) {
        out.narrow(0, r * n, n).copy_(order.narrow(0, layout_.slot(r) * n, n));
      }
    }
  }

  // Vendor-ordered copy; per chunk intra reduce, bridge reduce to the owner; intra scatter.
  void reduceScatter(const at::Tensor& in, const at::Tensor& out,
                                        const c10d::ReduceOp& op, bool average) {
    const int64_t n = out.numel();
    if (n == 0) {
      return;
    }
    const auto& intra = intraFor(in);
    const int me = layout_.myVendor();
    // A copy in vendor order: each vendor's blocks form one slice, reduced to its leader.
    at::Tensor order;
    if (layout_.rankOrderIsVendorOrder()) {
      order = in.clone();
    } else {
      order = at::empty_like(in);
      for (int r = 0; r < layout_.size(); ++r) {
        order.narrow(0, layout_.slot(r) * n, n).copy_(in.narrow(0, r * n, n));
      }
    }
    std::vector<Piece> pieces;
    for (int v = 0; v < layout_.numVendors(); ++v) {
      ChunkPipeline::split(pieces, layout_.firstSlot(v) * n, layout_.numMembers(v) * n,
                           elementsPerChunk(in), v);
    }
    auto chunk = [&](size_t i) { return order.narrow(0, pieces[i].offset, pieces[i].length); };
    ChunkSteps steps;
    if (intra) {
      steps.pre = [&](size_t i) { return reduceToLeader(intra, chunk(i), op); };
    }
    steps.bridge = [&](size_t i) { bridgeReduce(chunk(i), op, pieces[i].owner); };
    ChunkPipeline::run(pieces.size(), layout_.isLeader(), steps);

    const auto mine = order.narrow(0, layout_.firstSlot(me) * n, layout_.localSize() * n);
    if (intra) {
      std::vector<Tensors> ins;
      if (layout_.isLeader()) {
        ins.emplace_back();
        for (int k = 0; k < layout_.localSize(); ++k) {
          ins[0].push_back(mine.narrow(0, k * n, n));
        }
      }
      Tensors outs{out};
      c10d::ScatterOptions o;
      o.rootRank = 0;
      intra->scatter(outs, ins, o)->wait();
    } else {
      out.copy_(mine);
    }
    if (average) {
      out.div_(layout_.size());
    }
  }

 private:
  // One chunk's native step inside the vendor: reduce to the leader (vendor rank 0).
  static WorkPtr reduceToLeader(const InnerBackends::Ptr& intra, const at::Tensor& chunk,
                                const c10d::ReduceOp& op) {
    Tensors v{chunk};
    c10d::ReduceOptions o;
    o.reduceOp = op;
    o.rootRank = 0;
    return intra->reduce(v, o);
  }

  // One chunk's native step inside the vendor: broadcast from vendor rank localRoot.
  static WorkPtr broadcastInVendor(const InnerBackends::Ptr& intra, const at::Tensor& chunk,
                                   int localRoot) {
    Tensors v{chunk};
    c10d::BroadcastOptions o;
    o.rootRank = localRoot;
    return intra->broadcast(v, o);
  }

  // One chunk over the bridge: staged to host, reduced to rootVendor's leader, and the
  // result copied back into the chunk on that leader.
  void bridgeReduce(const at::Tensor& chunk, const c10d::ReduceOp& op, int rootVendor) {
    auto host = HostStager::toHost(chunk);
    Tensors v{host};
    c10d::ReduceOptions o;
    o.reduceOp = op;
    o.rootRank = rootVendor;
    inner_.bridge->reduce(v, o)->wait();
    if (rootVendor == layout_.myVendor()) {
      HostStager::upload(host, chunk);
    }
  }

  int64_t elementsPerChunk(const at::Tensor& t) const {
    return std::max<int64_t>(1, chunkBytes_ / static_cast<int64_t>(t.element_size()));
  }

  void broadcastFromLeader(const at::Tensor& flat) {
    const auto& intra = intraFor(flat);
    if (!intra) {
      return;
    }
    std::vector<Piece> pieces;
    ChunkPipeline::split(pieces, 0, flat.numel(), elementsPerChunk(flat));
    ChunkSteps steps;
    steps.post = [&](size_t i) {
      return broadcastInVendor(intra, flat.narrow(0, pieces[i].offset, pieces[i].length), 0);
    };
    ChunkPipeline::run(pieces.size(), false, steps);
  }

  const VendorLayout& layout_;
  const InnerBackends& inner_;
  int64_t chunkBytes_;
};

}  // namespace hetero
