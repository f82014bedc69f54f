// The chunked, pipelined schedule of the hierarchical collectives.
//
// A large tensor is cut into chunks; each chunk goes through up to three steps:
//   pre(i)    an inner (intra-vendor) operation, e.g. reduce to the vendor's leader;
//   bridge(i) on leaders only: the cross-vendor step, staged through host memory;
//   post(i)   an inner operation, e.g. broadcast from the leader.
// The inner operations are asynchronous, and pre() runs kDepth chunks ahead: while the
// leader moves chunk i across the bridge, the inner library already works on chunk i+1,
// and the post step of chunk i-1 is still in flight. Every rank of a vendor issues its
// inner operations in the same order (pre 0..kDepth-1, then post i, pre i+kDepth for each
// i), which the inner libraries need; a rank waits for pre(i) before issuing post(i)
// because both may touch the same memory.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include <torch/csrc/distributed/c10d/Work.hpp>

namespace hetero {

struct Piece {
  int64_t offset;  // elements
  int64_t length;  // elements
  int owner;       // a vendor, for operations whose chunks belong to one vendor (else -1)
};

struct ChunkSteps {
  using Issue = std::function<c10::intrusive_ptr<c10d::Work>(size_t)>;
  Issue pre;                           // empty, or may return a null work: nothing to do
  std::function<void(size_t)> bridge;  // called on leaders only, blocking
  Issue post;
};

class ChunkPipeline {
 public:
  static constexpr size_t kDepth = 2;

  // Cuts [offset, offset + length) into pieces of at most maxElements elements.
  static void split(std::vector<Piece>& out, int64_t offset, int64_t length, int64_t maxElements,
                    int owner = -1) {
    const int64_t step = std::max<int64_t>(1, maxElements);
    for (int64_t at = 0; at < length; at += step) {
      out.push_back(Piece{offset + at, std::min(step, length - at), owner});
    }
  }

  static void run(size_t numChunks, bool leader, const ChunkSteps& steps) {
    std::vector<c10::intrusive_ptr<c10d::Work>> pre(numChunks);
    std::vector<c10::intrusive_ptr<c10d::Work>> post;
    auto issuePre = [&](size_t i) {
      if (steps.pre) {
        pre[i] = steps.pre(i);
      }
    };
    for (size_t i = 0; i < std::min(kDepth, numChunks); ++i) {
      issuePre(i);
    }
    for (size_t i = 0; i < numChunks; ++i) {
      if (pre[i]) {
        pre[i]->wait();
        pre[i].reset();
      }
      if (leader && steps.bridge) {
        steps.bridge(i);
      }
      if (steps.post) {
        if (auto work = steps.post(i)) {
          post.push_back(std::move(work));
        }
      }
      if (i + kDepth < numChunks) {
        issuePre(i + kDepth);
      }
    }
    for (auto& work : post) {
      work->wait();
    }
  }
};

}  // namespace hetero
