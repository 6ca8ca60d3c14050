// CPU kernels where torch is slow. Registered into deepinfer._C by bind_cpu_kernels.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void bind_cpu_kernels(py::module_& m) { (void)m; }
