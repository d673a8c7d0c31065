// pybind11 binding of the Fit-Poly codec (fit.h): deepreduce._fit. Thin: converts arrays and
// calls fit.h; its errors reach Python as ValueError with fit.h's text (the Python codec reports
// them as ContainerError / DeepReduceError).
#include <string>

#include "common/py_args.h"
#include "fit.h"

namespace py = pybind11;
namespace fit = deepreduce::fit;
using deepreduce::py_args::FloatArray;

namespace {

py::array_t<int64_t> sort_desc(FloatArray values) {
    const int64_t n = values.size();
    py::array_t<int64_t> perm(n);
    int64_t* p = perm.mutable_data();
    py::gil_scoped_release release;
    fit::sort_desc(values.data(), n, p);
    return perm;
}

py::tuple encode(FloatArray values, int degree, int max_segments, int min_points, int coef_bytes) {
    const int64_t n = values.size();
    const int64_t bound = fit::payload_bound(n, degree, max_segments, coef_bytes);
    py::array_t<int64_t> perm(n);
    int64_t* p = perm.mutable_data();
    std::string out(static_cast<size_t>(bound), '\0');
    int64_t size;
    {
        py::gil_scoped_release release;
        size = fit::encode(values.data(), n, degree, max_segments, min_points, coef_bytes, p,
                           reinterpret_cast<uint8_t*>(&out[0]), bound);
    }
    out.resize(static_cast<size_t>(size));
    return py::make_tuple(perm, py::bytes(out));
}

py::array_t<float> decode(const py::bytes& payload, int64_t n, int degree, int coef_bytes) {
    if (n < 0) throw py::value_error("polyfit decode: negative value count");
    const std::string buf = payload;
    const uint8_t* data = reinterpret_cast<const uint8_t*>(buf.data());
    const int64_t len = static_cast<int64_t>(buf.size());
    fit::check_payload(data, len, n, degree, coef_bytes);  // before n outputs are allocated
    py::array_t<float> out(n);
    float* o = out.mutable_data();
    py::gil_scoped_release release;
    fit::decode(data, len, n, degree, coef_bytes, o);
    return out;
}

// (degree, coef_bytes) of checked params: PolyFit._params.
py::tuple unpack_params(const py::bytes& params) {
    const std::string b = params;
    const fit::Params p = fit::unpack_params(reinterpret_cast<const uint8_t*>(b.data()), b.size());
    return py::make_tuple(p.degree, p.coef_bytes);
}

}  // namespace

PYBIND11_MODULE(_fit, m) {
    deepreduce::py_args::register_errors();
    m.doc() = "Fit-Poly codec: signed descending sort, chord segmentation, Legendre least squares, params";
    m.def("sort_desc", &sort_desc, py::arg("values"), "Stable permutation sorting float32 values descending (signed).");
    m.def("encode", &encode, py::arg("values"), py::arg("degree"), py::arg("max_segments"), py::arg("min_points"),
          py::arg("coef_bytes"), "Fit-Poly encode: returns (permutation int64, payload bytes).");
    m.def("decode", &decode, py::arg("payload"), py::arg("n"), py::arg("degree"), py::arg("coef_bytes"),
          "Fit-Poly decode: n float32 values in sorted order.");
    m.def(
        "pack_params", [](int degree, int coef_bytes) { return py::bytes(fit::pack_params({degree, coef_bytes})); },
        py::arg("degree"), py::arg("coef_bytes"), "the params bytes (u8 degree, u8 coefficient bytes)");
    m.def("unpack_params", &unpack_params, py::arg("params"),
          "(degree, coef_bytes) of checked params; ValueError with the ContainerError text otherwise");
}
