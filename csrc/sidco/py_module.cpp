// pybind11 binding of the SIDCo kernels: deepreduce._sidco. Thin: arrays in, arrays out.
#include "common/py_args.h"
#include "sidco.h"

namespace py = pybind11;
namespace sidco = deepreduce::sidco;
using deepreduce::py_args::FloatArray;

namespace {

py::tuple abs_stats(FloatArray x, bool want_log) {
    double out[3];
    {
        py::gil_scoped_release release;
        sidco::abs_stats(x.data(), x.size(), want_log, out);
    }
    return py::make_tuple(static_cast<int64_t>(out[0]), out[1], out[2]);
}

double abs_sq_dev(FloatArray x, double mean) {
    py::gil_scoped_release release;
    return sidco::abs_sq_dev(x.data(), x.size(), mean);
}

py::array_t<float> abs_exceed(FloatArray x, float eta) {
    int64_t count;
    {
        py::gil_scoped_release release;
        count = sidco::abs_count(x.data(), x.size(), eta, true);
    }
    py::array_t<float> buf(count + 1);  // one spare slot for the branch-free writes
    int64_t written;
    {
        py::gil_scoped_release release;
        written = sidco::abs_exceed(x.data(), x.size(), eta, buf.mutable_data(), count + 1);
    }
    if (written != count) throw py::value_error("sidco abs_exceed: count changed between passes");
    return buf[py::slice(0, count, 1)].cast<py::array_t<float>>();
}

py::array_t<int64_t> abs_select(FloatArray x, float eta) {
    int64_t count;
    {
        py::gil_scoped_release release;
        count = sidco::abs_count(x.data(), x.size(), eta, false);
    }
    py::array_t<int64_t> buf(count + 1);  // one spare slot for the branch-free writes
    int64_t written;
    {
        py::gil_scoped_release release;
        written = sidco::abs_select(x.data(), x.size(), eta, buf.mutable_data(), count + 1);
    }
    if (written != count) throw py::value_error("sidco abs_select: count changed between passes");
    return buf[py::slice(0, count, 1)].cast<py::array_t<int64_t>>();
}

}  // namespace

PYBIND11_MODULE(_sidco, m) {
    deepreduce::py_args::register_errors();
    m.doc() = "SIDCo magnitude statistics and threshold selection (deepreduce C++ kernels)";
    m.def("abs_stats", &abs_stats, py::arg("x"), py::arg("want_log"),
          "(non-zero count, sum |x|, sum log|x| over non-zeros) in float64");
    m.def("abs_sq_dev", &abs_sq_dev, py::arg("x"), py::arg("mean"), "sum over non-zeros of (|x| - mean)^2");
    m.def("abs_exceed", &abs_exceed, py::arg("x"), py::arg("eta"), "|x_j| for |x_j| > eta, in order");
    m.def("abs_select", &abs_select, py::arg("x"), py::arg("eta"), "ascending j with |x_j| >= eta");
}
