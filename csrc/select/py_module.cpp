// pybind11 binding of the hot-path kernels: deepreduce._select. Arrays in, arrays out; the GIL
// is released around every kernel. In-place arguments (residual, out) must already be
// writeable C-contiguous float32 arrays: they are never converted (a copy would lose the write).
// Index arrays must have an integer dtype (a float array raises TypeError instead of being
// truncated); threads must be in [1, MAX_THREADS]; bad arguments raise (common/py_args.h), they
// never reach a kernel.
#include <algorithm>
#include <string>

#include "common/py_args.h"
#include "select.h"

namespace py = pybind11;
namespace sel = deepreduce::select;
using deepreduce::py_args::FloatInPlace;
using deepreduce::py_args::in_place_array;
using deepreduce::py_args::position_array;

namespace {

using FloatIn = deepreduce::py_args::FloatArray;
using IndexIn = deepreduce::py_args::I64Array;

// (finite, Top-r positions or None): see sel::scan. `prior` (None: the residual itself) is
// read and left intact; the residual receives prior + g.
py::tuple scan(FloatIn g, py::object residual, int64_t topk_r, int threads, py::object prior) {
    deepreduce::check_threads(threads);
    const int64_t n = g.size();
    float* r = nullptr;
    const float* p = nullptr;
    FloatInPlace res;
    FloatIn before;
    if (!residual.is_none()) {
        res = in_place_array(residual, "residual");
        if (res.size() != n) throw py::value_error("scan: residual and gradient differ in size");
        r = res.mutable_data();
        p = r;
    }
    if (!prior.is_none()) {
        if (!r) throw py::value_error("scan: prior needs a residual to write");
        before = FloatIn::ensure(prior);
        if (!before || before.size() != n) throw py::value_error("scan: prior and gradient differ in size");
        p = before.data();
        if (p == r) throw py::value_error("scan: prior and residual are one array: pass prior=None");
    }
    const bool select = topk_r > 0 && topk_r < n;
    py::array_t<int64_t> out(select ? topk_r : 0);
    int64_t* o = out.mutable_data();
    sel::Scan result;
    {
        py::gil_scoped_release release;
        result = sel::scan(g.data(), p, r, n, select ? topk_r : 0, threads, o);
    }
    if (result == sel::Scan::SELECTED) return py::make_tuple(true, out);
    return py::make_tuple(result == sel::Scan::FINITE, py::none());
}

py::array_t<int64_t> topk(FloatIn x, int64_t r, int threads) {
    deepreduce::check_threads(threads);
    const int64_t n = x.size();
    if (r <= 0 || r >= n) throw py::value_error("topk: r must satisfy 0 < r < n");
    py::array_t<int64_t> out(r);
    int64_t* o = out.mutable_data();
    {
        py::gil_scoped_release release;
        sel::topk(x.data(), n, r, threads, o);
    }
    return out;
}

py::array_t<int64_t> chunk_topk(FloatIn x, int64_t chunk, int64_t k, int64_t tail_k, int threads) {
    deepreduce::check_threads(threads);
    if (chunk <= 0 || chunk > (int64_t{1} << 31) || k < 0 || tail_k < 0)
        throw py::value_error("chunk_topk: needs 0 < chunk <= 2^31, k >= 0 and tail_k >= 0");
    const int64_t n = x.size(), rows = n / chunk, tail = n - rows * chunk;
    py::array_t<int64_t> out(rows * std::min(k, chunk) + std::min(tail_k, tail));
    int64_t* o = out.mutable_data();
    {
        py::gil_scoped_release release;
        sel::chunk_topk(x.data(), n, chunk, k, tail_k, threads, o);
    }
    return out;
}

py::array_t<int64_t> threshold(FloatIn x, float t, int threads) {
    deepreduce::check_threads(threads);
    std::vector<int64_t> found;
    {
        py::gil_scoped_release release;
        found = sel::threshold(x.data(), x.size(), t, threads);
    }
    py::array_t<int64_t> out(static_cast<py::ssize_t>(found.size()));
    if (!found.empty()) std::copy(found.begin(), found.end(), out.mutable_data());
    return out;
}

py::array_t<int64_t> nonzero(FloatIn x, int threads) {
    deepreduce::check_threads(threads);
    std::vector<int64_t> counts;
    {
        py::gil_scoped_release release;
        counts = sel::nonzero_counts(x.data(), x.size(), threads);
    }
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    py::array_t<int64_t> out(total);
    int64_t* o = out.mutable_data();
    {
        py::gil_scoped_release release;
        sel::nonzero(x.data(), x.size(), counts, o);
    }
    return out;
}

void check_scatter(const IndexIn& idx, const FloatIn& val) {
    if (idx.size() != val.size()) throw py::value_error("scatter_add: indices and values differ in length");
}

void scatter_add(py::object out_obj, py::array idx_obj, FloatIn val, int threads) {
    deepreduce::check_threads(threads);
    FloatInPlace out = in_place_array(out_obj, "out");
    IndexIn idx = position_array(idx_obj, "indices");
    check_scatter(idx, val);
    float* o = out.mutable_data();
    py::gil_scoped_release release;
    sel::scatter_add_checked(o, out.size(), idx.data(), val.data(), idx.size(), threads);
}

void scatter_add_unchecked(py::object out_obj, py::array idx_obj, FloatIn val, int threads) {
    deepreduce::check_threads(threads);
    FloatInPlace out = in_place_array(out_obj, "out");
    IndexIn idx = position_array(idx_obj, "indices");
    check_scatter(idx, val);
    float* o = out.mutable_data();
    py::gil_scoped_release release;
    sel::scatter_add_in_range(o, out.size(), idx.data(), val.data(), idx.size(), threads);
}

// (norms, levels, receiver's values) of qsgd_encode, or None if a bucket norm is not finite.
py::object qsgd_encode(FloatIn values, int levels, int64_t bucket_size, uint64_t seed, int threads) {
    deepreduce::check_threads(threads);
    if (levels < 1 || levels > 32767) throw py::value_error("qsgd_encode: levels must be in [1, 32767]");
    if (bucket_size < 1) throw py::value_error("qsgd_encode: bucket_size must be >= 1");
    const int64_t n = values.size();
    const int64_t width = std::min<int64_t>(bucket_size, std::max<int64_t>(n, 1));
    py::array_t<float> norms((n + width - 1) / width);
    py::array q = levels <= 127 ? py::array(py::array_t<int8_t>(n)) : py::array(py::array_t<int16_t>(n));
    py::array_t<float> recon(n);
    float* nu = norms.mutable_data();
    int8_t* q8 = levels <= 127 ? static_cast<int8_t*>(q.mutable_data()) : nullptr;
    int16_t* q16 = levels <= 127 ? nullptr : static_cast<int16_t*>(q.mutable_data());
    float* r = recon.mutable_data();
    bool finite;
    {
        py::gil_scoped_release release;
        finite = sel::qsgd_encode(values.data(), n, levels, bucket_size, seed, threads, nu, q8, q16, r);
    }
    if (!finite) return py::none();
    return py::make_tuple(norms, q, recon);
}

// (float32 means, uint8 codes) of binmean_codes, or None if a value is not finite.
py::object binmean_codes(FloatIn values, int bits, int iterations) {
    if (bits < 1 || bits > 4) throw py::value_error("binmean_codes: bits must be in [1, 4]");
    if (iterations < 0) throw py::value_error("binmean_codes: iterations must be >= 0");
    const int64_t n = values.size();
    py::array_t<float> means(int64_t{1} << bits);
    py::array_t<uint8_t> codes(n);
    float* m = means.mutable_data();
    uint8_t* c = codes.mutable_data();
    bool finite;
    {
        py::gil_scoped_release release;
        finite = sel::binmean_codes(values.data(), n, 1 << bits, iterations, m, c);
    }
    if (!finite) return py::none();
    return py::make_tuple(means, codes);
}

}  // namespace

PYBIND11_MODULE(_select, m) {
    deepreduce::py_args::register_errors();
    m.attr("MAX_THREADS") = deepreduce::MAX_THREADS;  // the one C++ thread limit (common/checks.h)
    m.doc() =
        "Hot-path kernels of deepreduce: compensation scan, Top-r / threshold / non-zero selection, scatter-add, "
        "QSGD encode, bin-mean codes";
    m.def("scan", &scan, py::arg("g"), py::arg("residual"), py::arg("topk_r"), py::arg("threads"),
          py::arg("prior") = py::none(),
          "(finite, Top-r positions or None); with a residual, residual = prior + g (prior None: in place; "
          "see select.h)");
    m.def("topk", &topk, py::arg("x"), py::arg("r"), py::arg("threads"),
          "ascending positions of the r largest |x| (ties: lowest position first)");
    m.def("chunk_topk", &chunk_topk, py::arg("x"), py::arg("chunk"), py::arg("k"), py::arg("tail_k"),
          py::arg("threads"),
          "ascending positions of the k largest |x| of every chunk and the tail_k largest of the tail chunk "
          "(ties: lowest position first)");
    m.def("threshold", &threshold, py::arg("x"), py::arg("t"), py::arg("threads"), "ascending j with |x_j| >= t");
    m.def("nonzero", &nonzero, py::arg("x"), py::arg("threads"),
          "ascending int64 positions of the non-zero entries (as numpy.flatnonzero)");
    m.def("scatter_add", &scatter_add, py::arg("out"), py::arg("indices"), py::arg("values"), py::arg("threads"),
          "out[indices] += values for strictly ascending in-range indices (ValueError otherwise)");
    m.def("scatter_add_unchecked", &scatter_add_unchecked, py::arg("out"), py::arg("indices"), py::arg("values"),
          py::arg("threads"),
          "out[indices] += values for distinct indices in any order (the range is checked: "
          "ValueError, nothing written; distinctness is the caller's)");
    m.def("binmean_codes", &binmean_codes, py::arg("values"), py::arg("bits"), py::arg("iterations"),
          "(float32 means, uint8 codes) of the bin-mean codec at 1-4 bits, or None if a value is not finite "
          "(deepreduce/values/binmean.py, the same codes and means)");
    m.def("qsgd_encode", &qsgd_encode, py::arg("values"), py::arg("levels"), py::arg("bucket_size"), py::arg("seed"),
          py::arg("threads"),
          "(float32 bucket norms, int8/int16 levels, float32 receiver's values) of QSGD, "
          "or None if a bucket norm is not finite (deepreduce/values/qsgd.py, the same bytes)");
}
