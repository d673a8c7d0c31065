// pybind11 bindings of the Bloom kernels (bloom.h) over NumPy buffers and bytes: deepreduce._bloom.
//
// Every argument is checked before a kernel runs: integers must be Python/NumPy integers within
// the documented range (ValueError, or TypeError for a non-integer such as a float), index arrays
// must be 1-D integer arrays without negative entries (a float array raises TypeError instead of
// being truncated), filters must have exactly the bytes their size implies. The kernels run
// without the GIL, on `threads` threads where the work is large enough. The Python codec turns
// ValueError/TypeError into deepreduce errors.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "bloom.h"

namespace py = pybind11;
namespace bl = deepreduce::bloom;

using U64Array = py::array_t<uint64_t, py::array::c_style>;

namespace {

constexpr uint64_t U64_MAX = ~uint64_t(0);

// An integer argument in [lo, hi]; TypeError for non-integers, ValueError out of range.
uint64_t int_arg(const py::handle& obj, const char* name, uint64_t lo, uint64_t hi) {
    if (py::isinstance<py::bool_>(obj) || !PyIndex_Check(obj.ptr()))
        throw py::type_error(std::string(name) + " must be an integer, got " +
                             std::string(py::str(py::type::of(obj).attr("__name__"))));
    py::int_ value = py::reinterpret_steal<py::int_>(PyNumber_Index(obj.ptr()));
    if (!value) throw py::error_already_set();
    const bool below = PyObject_RichCompareBool(value.ptr(), py::int_(lo).ptr(), Py_LT) == 1;
    const bool above = PyObject_RichCompareBool(value.ptr(), py::int_(hi).ptr(), Py_GT) == 1;
    if (below || above)
        throw py::value_error(std::string(name) + " = " + std::string(py::str(value)) + " is outside [" +
                              std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return PyLong_AsUnsignedLongLong(value.ptr());
}

int k_arg(const py::handle& obj) { return static_cast<int>(int_arg(obj, "k", 1, bl::MAX_K)); }
int threads_arg(const py::handle& obj) { return static_cast<int>(int_arg(obj, "threads", 1, bl::MAX_THREADS)); }

// `size` is the block count (blocked) or m (splitmix).
bl::Family family_arg(const std::string& family) {
    if (family == "blocked") return bl::Family::blocked;
    if (family == "splitmix") return bl::Family::splitmix;
    throw py::value_error("family must be 'blocked' or 'splitmix', got '" + family + "'");
}

uint64_t size_arg(const py::handle& obj, bl::Family family) {
    return family == bl::Family::blocked ? int_arg(obj, "blocks", 0, bl::blocked::MAX_BLOCKS)
                                         : int_arg(obj, "m", 0, U64_MAX);
}

uint64_t filter_bytes(bl::Family family, uint64_t size) {
    return family == bl::Family::blocked ? size * bl::blocked::BLOCK_BYTES : bl::filter_bytes(size);
}

// A 1-D array of non-negative integers as contiguous uint64.
U64Array index_array(const py::handle& obj, const char* name) {
    py::array arr = py::array::ensure(obj);
    if (!arr) throw py::type_error(std::string(name) + " must be an array of integers");
    const char kind = arr.dtype().kind();
    if (kind != 'i' && kind != 'u')
        throw py::type_error(std::string(name) + " must be an integer array, got dtype " +
                             std::string(py::str(arr.dtype())));
    if (arr.ndim() != 1) throw py::value_error(std::string(name) + " must be 1-D, got " + std::to_string(arr.ndim()) + " dimensions");
    if (kind == 'i') {
        py::array_t<int64_t, py::array::c_style | py::array::forcecast> signed_(arr);
        const int64_t* p = signed_.data();
        for (py::ssize_t a = 0; a < signed_.size(); ++a)
            if (p[a] < 0) throw py::value_error(std::string(name) + " must be non-negative, got " + std::to_string(p[a]));
    }
    return py::array_t<uint64_t, py::array::c_style | py::array::forcecast>(arr);
}

U64Array to_array(const std::vector<uint64_t>& v) {
    U64Array out(static_cast<py::ssize_t>(v.size()));
    if (!v.empty()) std::copy(v.begin(), v.end(), out.mutable_data());
    return out;
}

// Runs a kernel without the GIL, turning its std::invalid_argument into ValueError.
template <class F>
void run_released(F fn) {
    try {
        py::gil_scoped_release release;
        fn();
    } catch (const std::invalid_argument& e) {
        throw py::value_error(e.what());
    }
}

}  // namespace

PYBIND11_MODULE(_bloom, mod) {
    mod.doc() = "C++ Bloom filter kernels of deepreduce (hash families documented in docs/bloom.md)";

    mod.def("positions", [](py::object x, py::object size, py::object k, py::object seed, const std::string& family) {
        const bl::Family fam = family_arg(family);
        const uint64_t sz = size_arg(size, fam);
        const int kk = k_arg(k);
        const uint64_t s = int_arg(seed, "seed", 0, U64_MAX);
        U64Array idx = index_array(x, "x");
        if (sz == 0) throw py::value_error(fam == bl::Family::blocked ? "blocks must be positive" : "m must be positive");
        U64Array out({idx.size(), static_cast<py::ssize_t>(kk)});
        uint64_t* o = out.mutable_data();
        run_released([&] {
            if (fam == bl::Family::blocked)
                bl::blocked::positions(idx.data(), idx.size(), sz, kk, s, o);
            else
                bl::splitmix::positions(idx.data(), idx.size(), sz, kk, s, o);
        });
        return out;
    }, py::arg("x"), py::arg("size"), py::arg("k"), py::arg("seed"), py::arg("family") = "blocked",
       "bit positions of every x (an (n, k) uint64 array); size = blocks (blocked) or m (splitmix)");

    mod.def("build", [](py::object indices, py::object blocks, py::object k, py::object seed, py::object threads) {
        const uint64_t nb = int_arg(blocks, "blocks", 0, bl::blocked::MAX_BLOCKS);
        const int kk = k_arg(k);
        const uint64_t s = int_arg(seed, "seed", 0, U64_MAX);
        const int t = threads_arg(threads);
        U64Array idx = index_array(indices, "indices");
        if (nb == 0 && idx.size() > 0) throw py::value_error("blocks must be positive to insert indices");
        std::string bits(nb * bl::blocked::BLOCK_BYTES, '\0');
        uint8_t* b = reinterpret_cast<uint8_t*>(&bits[0]);
        run_released([&] { bl::blocked::build(idx.data(), idx.size(), nb, kk, s, b, t); });
        return py::bytes(bits);
    }, py::arg("indices"), py::arg("blocks"), py::arg("k"), py::arg("seed"), py::arg("threads") = 1,
       "the blocked filter bytes (64 per block) holding the given indices");

    mod.def("query", [](py::bytes data, py::object size, py::object k, py::object seed, py::object d,
                        py::object limit, py::object threads, const std::string& family, bool simd) {
        const bl::Family fam = family_arg(family);
        const uint64_t sz = size_arg(size, fam);
        const int kk = k_arg(k);
        const uint64_t s = int_arg(seed, "seed", 0, U64_MAX);
        const uint64_t dd = int_arg(d, "d", 0, U64_MAX);
        const uint64_t lim = int_arg(limit, "limit", 0, U64_MAX);
        const int t = threads_arg(threads);
        std::string bits = data;
        if (bits.size() != filter_bytes(fam, sz))
            throw py::value_error("Bloom filter has " + std::to_string(bits.size()) + " bytes, expected " +
                                  std::to_string(filter_bytes(fam, sz)) + " for " +
                                  (fam == bl::Family::blocked ? "blocks = " : "m = ") + std::to_string(sz));
        std::vector<uint64_t> out;
        const uint8_t* b = reinterpret_cast<const uint8_t*>(bits.data());
        run_released([&] {
            if (fam == bl::Family::blocked)
                bl::blocked::query(b, sz, kk, s, dd, lim, t, out, simd);
            else
                bl::splitmix::query(b, sz, kk, s, dd, lim, t, out);
        });
        return to_array(out);
    }, py::arg("bits"), py::arg("size"), py::arg("k"), py::arg("seed"), py::arg("d"), py::arg("limit"),
       py::arg("threads") = 1, py::arg("family") = "blocked", py::arg("simd") = true,
       "the first min(|P|, limit + 1) positives P in [0, d), ascending; simd=False forces the portable "
       "loop of the blocked family (the same result as its AVX2 code)");

    mod.def("select_random", [](py::object positives, py::object r, py::object draw_seed) {
        U64Array P = index_array(positives, "positives");
        const uint64_t rr = int_arg(r, "r", 0, static_cast<uint64_t>(P.size()));
        const uint64_t draw = int_arg(draw_seed, "draw_seed", 0, U64_MAX);
        U64Array out(static_cast<py::ssize_t>(rr));
        uint64_t* o = out.mutable_data();
        run_released([&] { bl::select_random(P.data(), P.size(), rr, draw, o); });
        return out;
    }, py::arg("positives"), py::arg("r"), py::arg("draw_seed"), "policy P1");

    mod.def("select_conflict", [](py::object positives, py::object r, py::object size, py::object k,
                                  py::object seed, py::object draw_seed, const std::string& family) {
        const bl::Family fam = family_arg(family);
        U64Array P = index_array(positives, "positives");
        const uint64_t rr = int_arg(r, "r", 0, static_cast<uint64_t>(P.size()));
        const uint64_t sz = size_arg(size, fam);
        const int kk = k_arg(k);
        const uint64_t s = int_arg(seed, "seed", 0, U64_MAX);
        const uint64_t draw = int_arg(draw_seed, "draw_seed", 0, U64_MAX);
        U64Array out(static_cast<py::ssize_t>(rr));
        uint64_t* o = out.mutable_data();
        run_released([&] { bl::select_conflict(fam, P.data(), P.size(), rr, sz, kk, s, draw, o); });
        return out;
    }, py::arg("positives"), py::arg("r"), py::arg("size"), py::arg("k"), py::arg("seed"), py::arg("draw_seed"),
       py::arg("family") = "blocked", "policy P2 (conflict sets, Algorithm 1)");

    mod.def("positive_limit", [](py::bytes data, py::object size, py::object k, py::object r, py::object d,
                                 const std::string& family, bool conflict) {
        const bl::Family fam = family_arg(family);
        const uint64_t sz = size_arg(size, fam);
        const int kk = k_arg(k);
        const uint64_t rr = int_arg(r, "r", 0, U64_MAX);
        const uint64_t dd = int_arg(d, "d", 0, U64_MAX);
        std::string bits = data;
        if (bits.size() != filter_bytes(fam, sz))
            throw py::value_error("Bloom filter has " + std::to_string(bits.size()) + " bytes, expected " +
                                  std::to_string(filter_bytes(fam, sz)) + " for " +
                                  (fam == bl::Family::blocked ? "blocks = " : "m = ") + std::to_string(sz));
        uint64_t limit = 0;
        const uint8_t* b = reinterpret_cast<const uint8_t*>(bits.data());
        run_released([&] { limit = bl::positive_limit(fam, b, sz, kk, rr, dd, conflict); });
        return limit;
    }, py::arg("bits"), py::arg("size"), py::arg("k"), py::arg("r"), py::arg("d"), py::arg("family") = "blocked",
       py::arg("conflict") = false,
       "the most positives among [0, d) accepted from a filter claiming r keys (bloom.h); conflict=True "
       "adds P2's checks (ValueError)");
}
