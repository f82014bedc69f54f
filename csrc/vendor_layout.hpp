// Which vendor each rank of a group belongs to, and the roles that follow from it.
//
// Vendors are numbered 0..V-1 by Python (in order of first appearance in the group).
// A vendor's members are its ranks in increasing order; the first one is its leader,
// the only rank of the vendor that talks to the other vendors in collectives.
// The "vendor order" lists the members of vendor 0, then those of vendor 1, ...; a
// rank's slot is its position in that order (collectives that move one block per rank
// keep their buffers in vendor order, so each vendor's blocks are contiguous).
#pragma once

#include <cstdint>
#include <vector>

#include <c10/util/Exception.h>

namespace hetero {

class VendorLayout {
 public:
  VendorLayout(int rank, const std::vector<int64_t>& vendorOfRank) : rank_(rank) {
    const int size = static_cast<int>(vendorOfRank.size());
    TORCH_CHECK(rank >= 0 && rank < size, "hetero backend: rank ", rank, " outside a group of ", size);
    for (int r = 0; r < size; ++r) {
      const int64_t v = vendorOfRank[r];
      TORCH_CHECK(v >= 0 && v <= static_cast<int64_t>(members_.size()),
                  "hetero backend: vendors must be numbered in order of first appearance");
      if (v == static_cast<int64_t>(members_.size())) {
        members_.emplace_back();
      }
      vendor_.push_back(static_cast<int>(v));
      local_.push_back(static_cast<int>(members_[v].size()));
      members_[v].push_back(r);
    }
    int next = 0;
    for (const auto& m : members_) {
      firstSlot_.push_back(next);
      next += static_cast<int>(m.size());
    }
    for (int r = 0; r < size; ++r) {
      slot_.push_back(firstSlot_[vendor_[r]] + local_[r]);
      rankOrder_ = rankOrder_ && slot_[r] == r;
    }
  }

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(vendor_.size()); }
  int numVendors() const { return static_cast<int>(members_.size()); }
  int vendorOf(int rank) const { return vendor_.at(rank); }
  int myVendor() const { return vendor_[rank_]; }
  const std::vector<int>& members(int vendor) const { return members_.at(vendor); }
  int numMembers(int vendor) const { return static_cast<int>(members_.at(vendor).size()); }
  // Index of a rank among the members of its vendor (its rank in the vendor's own group).
  int localRank(int rank) const { return local_.at(rank); }
  int localSize() const { return numMembers(myVendor()); }
  int leaderOf(int vendor) const { return members_.at(vendor).front(); }
  bool isLeader() const { return local_[rank_] == 0; }
  int slot(int rank) const { return slot_.at(rank); }
  int firstSlot(int vendor) const { return firstSlot_.at(vendor); }
  // True when every vendor's ranks are contiguous and in vendor order (slot == rank).
  bool rankOrderIsVendorOrder() const { return rankOrder_; }

 private:
  int rank_;
  std::vector<int> vendor_;
  std::vector<int> local_;
  std::vector<int> slot_;
  std::vector<int> firstSlot_;
  std::vector<std::vector<int>> members_;
  bool rankOrder_ = true;
};

}  // namespace hetero
