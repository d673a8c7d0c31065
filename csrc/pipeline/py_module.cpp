// pybind11 binding of the C++ pipeline subset (pipeline.h): deepreduce._pipeline, the functions
// the TensorFlow ops run, callable from NumPy (deepreduce/backend/native_pipeline.py builds the
// settings from a core pipeline; tests compare the bytes with the core's).
#include <string>

#include "bloom_wire.h"
#include "common/py_args.h"
#include "pipeline.h"

namespace py = pybind11;
namespace pl = deepreduce::pipeline;
using deepreduce::py_args::Bytes;
using deepreduce::py_args::FloatArray;
using deepreduce::py_args::FloatInPlace;

namespace {

// EncodeConfig from native_pipeline.settings(core): a dict of plain values.
pl::EncodeConfig encode_config(const py::dict& s) {
    pl::EncodeConfig c;
    c.digest = s["digest"].cast<std::string>();
    c.min_numel = s["min_numel"].cast<int64_t>();
    c.sparsifier = pl::sparsifier_named(s["sparsifier"].cast<std::string>());
    c.ratio = s["ratio"].cast<double>();
    c.threshold = s["threshold"].cast<float>();
    c.error_feedback = s["error_feedback"].cast<bool>();
    c.index = pl::index_named(s["index"].cast<std::string>());
    c.policy = deepreduce::bloom::policy_code(s["policy"].cast<std::string>());
    c.keys_per_block = s["keys_per_block"].cast<double>();
    c.k = s["k"].cast<int>();
    c.hash_seed = s["hash_seed"].cast<uint64_t>();
    c.value = pl::value_named(s["value"].cast<std::string>());
    c.degree = s["degree"].cast<int>();
    c.segments = s["segments"].cast<int>();
    c.min_points = s["min_points"].cast<int>();
    c.coef_bytes = s["coef_bytes"].cast<int>();
    c.threads = s["threads"].cast<int>();
    c.check();
    return c;
}

// (container as a uint8 array, the residual: `residual` updated in place, a new array on the
// tensor's first finite step with error feedback, else None).
py::tuple encode(const py::dict& settings, const std::string& name, int64_t step, const py::array& grad,
                 const py::object& residual) {
    const pl::EncodeConfig c = encode_config(settings);
    FloatArray g = FloatArray::ensure(grad);
    if (!g) throw py::type_error("grad must be convertible to a float32 array");
    std::vector<uint64_t> shape;
    for (py::ssize_t d = 0; d < g.ndim(); ++d) shape.push_back(static_cast<uint64_t>(g.shape(d)));
    py::object res_out = residual;
    float* res = nullptr;
    int64_t res_numel = 0;
    if (!residual.is_none()) {
        FloatInPlace r = deepreduce::py_args::in_place_array(residual, "residual");
        res = r.mutable_data();
        res_numel = r.size();
    }
    py::array_t<uint8_t> payload;
    // encode runs without the GIL; the allocators take it back to create their arrays
    const pl::ResidualAllocator new_residual = [&](int64_t numel) {
        py::gil_scoped_acquire acquire;
        FloatInPlace created(numel);
        res_out = created;
        return created.mutable_data();
    };
    const pl::PayloadAllocator allocate = [&](size_t bytes) {
        py::gil_scoped_acquire acquire;
        payload = py::array_t<uint8_t>(static_cast<py::ssize_t>(bytes));
        return payload.mutable_data();
    };
    {
        py::gil_scoped_release release;
        pl::encode(c, name, step, g.data(), shape, res, res_numel, new_residual, allocate);
    }
    return py::make_tuple(payload, res_out);
}

py::array_t<float> decode_sum(const py::buffer& buf, int64_t count, bool single, const py::object& shape,
                              uint64_t max_numel, int threads) {
    py::buffer_info info;
    const Bytes b = deepreduce::py_args::bytes_arg(buf, info, "payload");
    pl::DecodeConfig c;
    c.count = count;
    c.single = single;
    c.check_shape = !shape.is_none();
    if (c.check_shape)
        for (const auto& s : shape) c.shape.push_back(s.cast<uint64_t>());
    c.max_numel = max_numel;
    c.threads = threads;
    py::array_t<float> out;
    {  // decode runs without the GIL; the allocator takes it back to create the array
        py::gil_scoped_release release;
        pl::decode_sum(c, b.data, b.size, [&](const std::vector<uint64_t>& dims, uint64_t) {
            py::gil_scoped_acquire acquire;
            std::vector<py::ssize_t> extents(dims.begin(), dims.end());
            out = py::array_t<float>(extents);
            return out.mutable_data();
        });
    }
    return out;
}

}  // namespace

PYBIND11_MODULE(_pipeline, m) {
    deepreduce::py_args::register_errors();
    m.doc() = "The C++ pipeline subset the TensorFlow ops run: encode one tensor, decode and sum containers";
    m.def("encode", &encode, py::arg("settings"), py::arg("name"), py::arg("step"), py::arg("grad"),
          py::arg("residual"),
          "(container uint8 array, residual or None) of Pipeline.encode; the residual is updated in place");
    m.def("decode_sum", &decode_sum, py::arg("payload"), py::arg("count") = -1, py::arg("single") = false,
          py::arg("shape") = py::none(), py::arg("max_numel") = ~uint64_t(0), py::arg("threads") = 1,
          "Pipeline.decode_sum (single: Pipeline.decode) of the containers in payload");
}
