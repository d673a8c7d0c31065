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
using Bounds = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;  // shard bounds

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

// The residual arguments of encode and encode_shards: the array written (None: the tensor has
// none yet) and the residual before the step it reads (None: the same array, in place; `keep`
// holds a converted prior alive).
pl::Residual residual_arg(const py::object& residual, const py::object& prior, FloatArray& keep) {
    pl::Residual r;
    if (residual.is_none()) {
        if (!prior.is_none()) throw py::value_error("prior needs a residual to write");
        return r;
    }
    FloatInPlace data = deepreduce::py_args::in_place_array(residual, "residual");
    r.data = data.mutable_data();
    r.numel = static_cast<int64_t>(data.size());
    if (!prior.is_none()) {
        keep = FloatArray::ensure(prior);
        if (!keep || keep.size() != data.size()) throw py::value_error("prior and residual differ in size");
        if (keep.data() == r.data) throw py::value_error("prior and residual are one array: pass prior=None");
        r.prior = keep.data();
    }
    return r;
}

// (container as a uint8 array, the residual: `residual` updated in place, a new array on the
// tensor's first finite step with error feedback, else None).
py::tuple encode(const py::dict& settings, const std::string& name, int64_t step, const py::array& grad,
                 const py::object& residual, const py::object& prior) {
    const pl::EncodeConfig c = encode_config(settings);
    FloatArray g = FloatArray::ensure(grad);
    if (!g) throw py::type_error("grad must be convertible to a float32 array");
    std::vector<uint64_t> shape;
    for (py::ssize_t d = 0; d < g.ndim(); ++d) shape.push_back(static_cast<uint64_t>(g.shape(d)));
    py::object res_out = residual;
    FloatArray kept_prior;
    const pl::Residual res = residual_arg(residual, prior, kept_prior);
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
        pl::encode(c, name, step, g.data(), shape, res, new_residual, allocate);
    }
    return py::make_tuple(payload, res_out);
}

// (containers as uint8 arrays, the residual as in encode, each container's (index, value,
// permutation) section bytes) of Pipeline.encode_shards of the flat float32 `grad`.
py::tuple encode_shards(const py::dict& settings, const std::string& name, int64_t step, const py::array& grad,
                        const Bounds& bounds_arg, const py::object& residual, const py::object& prior) {
    const std::vector<int64_t> bounds(bounds_arg.data(), bounds_arg.data() + bounds_arg.size());
    const pl::EncodeConfig c = encode_config(settings);
    FloatArray g = FloatArray::ensure(grad);
    if (!g || g.ndim() != 1) throw py::type_error("grad must be convertible to a flat float32 array");
    py::object res_out = residual;
    FloatArray kept_prior;
    const pl::Residual res = residual_arg(residual, prior, kept_prior);
    std::vector<py::array_t<uint8_t>> payloads(bounds.empty() ? 0 : bounds.size() - 1);
    const pl::ResidualAllocator new_residual = [&](int64_t numel) {
        py::gil_scoped_acquire acquire;
        FloatInPlace created(numel);
        res_out = created;
        return created.mutable_data();
    };
    const pl::ShardAllocator allocate = [&](size_t shard, size_t bytes) {
        py::gil_scoped_acquire acquire;
        payloads[shard] = py::array_t<uint8_t>(static_cast<py::ssize_t>(bytes));
        return payloads[shard].mutable_data();
    };
    std::vector<deepreduce::container::Header> headers;
    {
        py::gil_scoped_release release;
        headers = pl::encode_shards(c, name, step, g.data(), static_cast<int64_t>(g.size()), bounds, res, new_residual,
                                    allocate);
    }
    namespace ct = deepreduce::container;
    py::list sections;
    for (const auto& h : headers)
        sections.append(py::make_tuple(h.lengths[ct::INDEX], h.lengths[ct::VALUE], h.lengths[ct::PERM]));
    py::list containers;
    for (const auto& p : payloads) containers.append(p);
    return py::make_tuple(containers, res_out, sections);
}

// Each container of `payloads` (a sequence of buffers) where it lies; `infos` keeps them alive.
std::vector<pl::Part> parts_arg(const py::sequence& payloads, std::vector<py::buffer_info>& infos) {
    infos.resize(payloads.size());
    std::vector<pl::Part> parts;
    for (size_t j = 0; j < infos.size(); ++j) {
        const Bytes b = deepreduce::py_args::bytes_arg(payloads[j].cast<py::buffer>(), infos[j], "payload");
        parts.push_back({b.data, b.size});
    }
    return parts;
}

// The decode settings every decode binding takes: the expected shape (None: any), the largest
// numel a container may claim without one, the threads.
pl::DecodeConfig decode_config(const py::object& shape, uint64_t max_numel, int threads) {
    pl::DecodeConfig c;
    c.check_shape = !shape.is_none();
    if (c.check_shape)
        for (const auto& s : shape) c.shape.push_back(s.cast<uint64_t>());
    c.max_numel = max_numel;
    c.threads = threads;
    return c;
}

// The decoded tensor, created as a NumPy array (the GIL taken back for it); NumPy's MemoryError
// for the tensor a container claims is a CONTAINER error that names the claim.
float* new_tensor(py::array_t<float>& out, const std::vector<uint64_t>& dims, uint64_t numel) {
    py::gil_scoped_acquire acquire;
    std::vector<py::ssize_t> extents(dims.begin(), dims.end());
    try {
        out = py::array_t<float>(extents);
    } catch (py::error_already_set& e) {
        if (!e.matches(PyExc_MemoryError)) throw;
        throw deepreduce::Error(deepreduce::ErrorKind::CONTAINER,
                                "container claims a tensor of " + std::to_string(numel) +
                                    " elements, which could not be allocated: " + e.what());
    }
    return out.mutable_data();
}

py::array_t<float> decode_parts(const py::sequence& payloads, const py::object& shape, uint64_t max_numel,
                                int threads) {
    std::vector<py::buffer_info> infos;
    const std::vector<pl::Part> parts = parts_arg(payloads, infos);
    pl::DecodeConfig c = decode_config(shape, max_numel, threads);
    py::array_t<float> out;
    {  // decode runs without the GIL; the allocator takes it back to create the array
        py::gil_scoped_release release;
        pl::decode_sum(c, parts,
                       [&](const std::vector<uint64_t>& dims, uint64_t numel) { return new_tensor(out, dims, numel); });
    }
    return out;
}

void decode_shards(const py::sequence& payloads, const Bounds& bounds_arg, const py::object& out, int threads,
                   float divisor) {
    const std::vector<int64_t> bounds(bounds_arg.data(), bounds_arg.data() + bounds_arg.size());
    std::vector<py::buffer_info> infos;
    const std::vector<pl::Part> parts = parts_arg(payloads, infos);
    FloatInPlace target = deepreduce::py_args::in_place_array(out, "out");
    if (bounds.empty() || target.size() != bounds.back())
        throw py::value_error("out must hold the " + std::to_string(bounds.empty() ? 0 : bounds.back()) +
                              " elements the shard bounds cover");
    float* data = target.mutable_data();
    py::gil_scoped_release release;
    pl::decode_shards(parts, bounds, data, threads, divisor);
}

py::array_t<float> decode_sum(const py::buffer& buf, int64_t count, bool single, const py::object& shape,
                              uint64_t max_numel, int threads) {
    py::buffer_info info;
    const Bytes b = deepreduce::py_args::bytes_arg(buf, info, "payload");
    pl::DecodeConfig c = decode_config(shape, max_numel, threads);
    c.count = count;
    c.single = single;
    py::array_t<float> out;
    {  // decode runs without the GIL; the allocator takes it back to create the array
        py::gil_scoped_release release;
        pl::decode_sum(c, b.data, b.size,
                       [&](const std::vector<uint64_t>& dims, uint64_t numel) { return new_tensor(out, dims, numel); });
    }
    return out;
}

}  // namespace

PYBIND11_MODULE(_pipeline, m) {
    deepreduce::py_args::register_errors();
    m.doc() = "The C++ pipeline subset the TensorFlow ops run: encode one tensor, decode and sum containers";
    m.def("encode", &encode, py::arg("settings"), py::arg("name"), py::arg("step"), py::arg("grad"),
          py::arg("residual"), py::arg("prior") = py::none(),
          "(container uint8 array, residual or None) of Pipeline.encode; the residual receives prior + grad "
          "(prior None: in place)");
    m.def("decode_sum", &decode_sum, py::arg("payload"), py::arg("count") = -1, py::arg("single") = false,
          py::arg("shape") = py::none(), py::arg("max_numel") = ~uint64_t(0), py::arg("threads") = 1,
          "Pipeline.decode_sum (single: Pipeline.decode) of the containers in payload");
    m.def("encode_shards", &encode_shards, py::arg("settings"), py::arg("name"), py::arg("step"), py::arg("grad"),
          py::arg("bounds"), py::arg("residual"), py::arg("prior") = py::none(),
          "(containers, residual or None, their (index, value, permutation) section bytes) of "
          "Pipeline.encode_shards; the residual receives prior + grad (prior None: in place)");
    m.def("decode_parts", &decode_parts, py::arg("payloads"), py::arg("shape") = py::none(),
          py::arg("max_numel") = ~uint64_t(0), py::arg("threads") = 1,
          "Pipeline.decode_sum of a sequence of containers, each decoded where it lies");
    m.def("decode_shards", &decode_shards, py::arg("payloads"), py::arg("bounds"), py::arg("out"),
          py::arg("threads") = 1, py::arg("divisor") = 1.0f,
          "container j (Pipeline.decode, shape checked) written to out[bounds[j]:bounds[j+1]], divided by divisor");
}
