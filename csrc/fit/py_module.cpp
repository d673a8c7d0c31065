// pybind11 binding of the Fit-Poly kernel: deepreduce._fit. Thin: converts arrays, calls the
// C API of fit.h, turns negative codes into ValueError (the Python codec reports them as
// ContainerError / DeepReduceError).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "fit.h"

namespace py = pybind11;

namespace {

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

void check(int64_t rc) {
  if (rc < 0) throw std::invalid_argument(dr_fit_error_message(static_cast<int>(rc)));
}

py::array_t<int64_t> sort_desc(FloatArray values) {
  const int64_t n = values.size();
  py::array_t<int64_t> perm(n);
  int rc;
  {
    py::gil_scoped_release release;
    rc = dr_sort_desc(values.data(), n, perm.mutable_data());
  }
  check(rc);
  return perm;
}

py::tuple encode(FloatArray values, int degree, int max_segments, int min_points, int coef_bytes) {
  const int64_t n = values.size();
  int64_t bound = dr_polyfit_payload_bound(n, degree, max_segments, coef_bytes);
  check(bound);
  py::array_t<int64_t> perm(n);
  std::string out(static_cast<size_t>(bound), '\0');
  int64_t size;
  {
    py::gil_scoped_release release;
    size = dr_polyfit_encode(values.data(), n, degree, max_segments, min_points, coef_bytes,
                             perm.mutable_data(), reinterpret_cast<uint8_t*>(&out[0]), bound);
  }
  check(size);
  out.resize(static_cast<size_t>(size));
  return py::make_tuple(perm, py::bytes(out));
}

py::array_t<float> decode(py::bytes payload, int64_t n, int degree, int coef_bytes) {
  if (n < 0) throw std::invalid_argument("polyfit decode: negative value count");
  std::string buf = payload;
  check(dr_polyfit_check(reinterpret_cast<const uint8_t*>(buf.data()), static_cast<int64_t>(buf.size()), n,
                         degree, coef_bytes));   // before n outputs are allocated
  py::array_t<float> out(n);
  int rc;
  {
    py::gil_scoped_release release;
    rc = dr_polyfit_decode(reinterpret_cast<const uint8_t*>(buf.data()),
                           static_cast<int64_t>(buf.size()), n, degree, coef_bytes,
                           out.mutable_data());
  }
  check(rc);
  return out;
}

}  // namespace

PYBIND11_MODULE(_fit, m) {
  m.doc() = "Fit-Poly kernel: signed descending sort, chord segmentation, Legendre least squares";
  m.def("sort_desc", &sort_desc, py::arg("values"),
        "Stable permutation sorting float32 values descending (signed).");
  m.def("encode", &encode, py::arg("values"), py::arg("degree"), py::arg("max_segments"),
        py::arg("min_points"), py::arg("coef_bytes"),
        "Fit-Poly encode: returns (permutation int64, payload bytes).");
  m.def("decode", &decode, py::arg("payload"), py::arg("n"), py::arg("degree"),
        py::arg("coef_bytes"), "Fit-Poly decode: n float32 values in sorted order.");
}
