// pybind11 binding of the SIDCo kernels: deepreduce._sidco. Thin: arrays in, arrays out.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>

#include "sidco.h"

namespace py = pybind11;

namespace {

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

py::tuple abs_stats(FloatArray x, bool want_log) {
  double out[3];
  {
    py::gil_scoped_release release;
    dr_sidco_abs_stats(x.data(), x.size(), want_log ? 1 : 0, out);
  }
  return py::make_tuple(static_cast<int64_t>(out[0]), out[1], out[2]);
}

double abs_sq_dev(FloatArray x, double mean) {
  py::gil_scoped_release release;
  return dr_sidco_abs_sq_dev(x.data(), x.size(), mean);
}

py::array_t<float> abs_exceed(FloatArray x, float eta) {
  int64_t count;
  {
    py::gil_scoped_release release;
    count = dr_sidco_abs_count(x.data(), x.size(), eta, 1);
  }
  py::array_t<float> buf(count + 1);  // one spare slot for the branch-free writes
  int64_t written;
  {
    py::gil_scoped_release release;
    written = dr_sidco_abs_exceed(x.data(), x.size(), eta, buf.mutable_data(), count + 1);
  }
  if (written != count) throw std::runtime_error("sidco abs_exceed: count changed between passes");
  return buf[py::slice(0, count, 1)].cast<py::array_t<float>>();
}

py::array_t<int64_t> abs_select(FloatArray x, float eta) {
  int64_t count;
  {
    py::gil_scoped_release release;
    count = dr_sidco_abs_count(x.data(), x.size(), eta, 0);
  }
  py::array_t<int64_t> buf(count + 1);  // one spare slot for the branch-free writes
  int64_t written;
  {
    py::gil_scoped_release release;
    written = dr_sidco_abs_select(x.data(), x.size(), eta, buf.mutable_data(), count + 1);
  }
  if (written != count) throw std::runtime_error("sidco abs_select: count changed between passes");
  return buf[py::slice(0, count, 1)].cast<py::array_t<int64_t>>();
}

}  // namespace

PYBIND11_MODULE(_sidco, m) {
  m.doc() = "SIDCo magnitude statistics and threshold selection (deepreduce C++ kernels)";
  m.def("abs_stats", &abs_stats, py::arg("x"), py::arg("want_log"),
        "(non-zero count, sum |x|, sum log|x| over non-zeros) in float64");
  m.def("abs_sq_dev", &abs_sq_dev, py::arg("x"), py::arg("mean"),
        "sum over non-zeros of (|x| - mean)^2");
  m.def("abs_exceed", &abs_exceed, py::arg("x"), py::arg("eta"), "|x_j| for |x_j| > eta, in order");
  m.def("abs_select", &abs_select, py::arg("x"), py::arg("eta"), "ascending j with |x_j| >= eta");
}
