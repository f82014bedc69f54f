// Python bindings of hetero_comm._comm_ext: the HeteroBackend class, built by hetero/comm.
#include <torch/csrc/utils/pybind.h>

#include "hetero_backend.hpp"

namespace py = pybind11;

namespace {

c10::intrusive_ptr<c10d::Backend> optionalBackend(const py::object& obj) {
  if (obj.is_none()) {
    return {};
  }
  return obj.cast<c10::intrusive_ptr<c10d::Backend>>();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "C++ data movement of the hetero torch.distributed backend (see hetero_comm)";
  py::module_::import("torch.distributed");  // registers c10d::Backend with pybind11

  py::class_<hetero::HeteroBackend, c10d::Backend, c10::intrusive_ptr<hetero::HeteroBackend>>(
      m, "HeteroBackend")
      .def(py::init([](int rank, int size, const std::vector<int64_t>& vendorOfRank,
                       const py::object& hostIntra, const py::object& deviceIntra,
                       const py::object& bridge, const py::object& full, int64_t chunkBytes) {
             hetero::HeteroBackend::Inner inner{optionalBackend(hostIntra),
                                                optionalBackend(deviceIntra),
                                                optionalBackend(bridge), optionalBackend(full)};
             return c10::make_intrusive<hetero::HeteroBackend>(rank, size, vendorOfRank,
                                                               std::move(inner), chunkBytes);
           }),
           py::arg("rank"), py::arg("size"), py::arg("vendor_of_rank"), py::arg("host_intra"),
           py::arg("device_intra"), py::arg("bridge"), py::arg("full"), py::arg("chunk_bytes"))
      .def_property_readonly("pass_through", &hetero::HeteroBackend::passThrough)
      .def_property_readonly("chunk_bytes", &hetero::HeteroBackend::chunkBytes)
      .def_property_readonly("num_vendors",
                             [](const hetero::HeteroBackend& b) { return b.layout().numVendors(); })
      .def_property_readonly("is_leader",
                             [](const hetero::HeteroBackend& b) { return b.layout().isLeader(); });

  m.def("built_with_cuda", [] {
#ifdef HETERO_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
}
