// pybind11 bindings of the Bloom kernels (bloom.h) over NumPy buffers and bytes.
// Errors in the arguments raise ValueError; the Python codec turns them into ContainerError.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "bloom.h"

namespace py = pybind11;
namespace bl = deepreduce::bloom;

using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

namespace {

U64Array to_array(const std::vector<uint64_t>& v) {
    U64Array out(static_cast<py::ssize_t>(v.size()));
    if (!v.empty()) std::copy(v.begin(), v.end(), out.mutable_data());
    return out;
}

void check_filter(const std::string& bits, uint64_t m) {
    if (bits.size() != bl::filter_bytes(m))
        throw py::value_error("Bloom filter has " + std::to_string(bits.size()) + " bytes, expected " +
                              std::to_string(bl::filter_bytes(m)) + " for m = " + std::to_string(m));
}

}  // namespace

PYBIND11_MODULE(_bloom, mod) {
    mod.doc() = "C++ Bloom filter kernels of deepreduce (hash family documented in docs/bloom.md)";

    mod.def("positions", [](U64Array x, uint64_t m, int k, uint64_t seed) {
        if (k < 1 || k > bl::MAX_K) throw py::value_error("k must be in [1, 64]");
        if (m == 0) throw py::value_error("m must be positive");
        U64Array out({x.size(), static_cast<py::ssize_t>(k)});
        bl::positions(x.data(), x.size(), m, k, seed, out.mutable_data());
        return out;
    }, py::arg("x"), py::arg("m"), py::arg("k"), py::arg("seed"),
       "h_i(x) for every x and i < k, as an (n, k) uint64 array");

    mod.def("build", [](U64Array idx, uint64_t m, int k, uint64_t seed) {
        if (k < 1 || k > bl::MAX_K) throw py::value_error("k must be in [1, 64]");
        if (m == 0 && idx.size() > 0) throw py::value_error("m must be positive to insert indices");
        std::string bits(bl::filter_bytes(m), '\0');
        {
            py::gil_scoped_release release;
            bl::build(idx.data(), idx.size(), m, k, seed, reinterpret_cast<uint8_t*>(&bits[0]));
        }
        return py::bytes(bits);
    }, py::arg("indices"), py::arg("m"), py::arg("k"), py::arg("seed"),
       "the filter bytes (ceil(m/8), LSB first) holding the given indices");

    mod.def("query", [](py::bytes data, uint64_t m, int k, uint64_t seed, uint64_t d, uint64_t limit) {
        if (k < 1 || k > bl::MAX_K) throw py::value_error("k must be in [1, 64]");
        std::string bits = data;
        check_filter(bits, m);
        std::vector<uint64_t> out;
        {
            py::gil_scoped_release release;
            bl::query(reinterpret_cast<const uint8_t*>(bits.data()), m, k, seed, d, limit, out);
        }
        return to_array(out);
    }, py::arg("bits"), py::arg("m"), py::arg("k"), py::arg("seed"), py::arg("d"), py::arg("limit"),
       "ascending positives in [0, d); stops once more than `limit` are found");

    mod.def("select_random", [](U64Array P, size_t r, uint64_t draw_seed) {
        if (r > static_cast<size_t>(P.size())) throw py::value_error("more indices requested than positives");
        U64Array out(static_cast<py::ssize_t>(r));
        {
            py::gil_scoped_release release;
            bl::select_random(P.data(), P.size(), r, draw_seed, out.mutable_data());
        }
        return out;
    }, py::arg("positives"), py::arg("r"), py::arg("draw_seed"), "policy P1");

    mod.def("select_conflict", [](U64Array P, size_t r, uint64_t m, int k, uint64_t seed, uint64_t draw_seed) {
        if (r > static_cast<size_t>(P.size())) throw py::value_error("more indices requested than positives");
        if (static_cast<uint64_t>(P.size()) >= (uint64_t(1) << 32)) throw py::value_error("too many positives for P2");
        U64Array out(static_cast<py::ssize_t>(r));
        try {
            py::gil_scoped_release release;
            bl::select_conflict(P.data(), P.size(), r, m, k, seed, draw_seed, out.mutable_data());
        } catch (const std::invalid_argument& e) {
            throw py::value_error(e.what());
        }
        return out;
    }, py::arg("positives"), py::arg("r"), py::arg("m"), py::arg("k"), py::arg("seed"), py::arg("draw_seed"),
       "policy P2 (conflict sets, Algorithm 1)");
}
