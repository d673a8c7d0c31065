// pybind11 binding of the hot-path kernels: deepreduce._select. Arrays in, arrays out; the GIL
// is released around every kernel. In-place arguments (residual, out) must already be
// writeable C-contiguous float32 arrays: they are never converted (a copy would lose the write).
// Index arrays must have an integer dtype (a float array raises TypeError instead of being
// truncated); threads must be in [1, 256]; bad arguments raise, they never reach a kernel.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "select.h"

namespace py = pybind11;

namespace {

using FloatIn = py::array_t<float, py::array::c_style | py::array::forcecast>;
using FloatInPlace = py::array_t<float, py::array::c_style>;
using IndexIn = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

constexpr int kMaxThreads = 256;

int checked_threads(int threads) {
  if (threads < 1 || threads > kMaxThreads) throw std::invalid_argument("threads must be in [1, 256]");
  return threads;
}

// An index argument as int64: integer dtypes only (no silent truncation of floats).
IndexIn index_arg(const py::array& arr, const char* name) {
  const char kind = arr.dtype().kind();
  if (kind != 'i' && kind != 'u')
    throw py::type_error(std::string(name) + " must be an integer array, got dtype " + std::string(py::str(arr.dtype())));
  return IndexIn::ensure(arr);
}

// An in-place float32 argument, checked rather than converted (TypeError names it).
FloatInPlace in_place_arg(const py::object& obj, const char* name) {
  if (!FloatInPlace::check_(obj) || !py::cast<py::array>(obj).writeable())
    throw py::type_error(std::string(name) + " must be a writeable C-contiguous float32 array");
  return py::reinterpret_borrow<FloatInPlace>(obj);
}

// (finite, Top-r positions or None): see dr_select::scan.
py::tuple scan(FloatIn g, py::object residual, int64_t topk_r, int threads) {
  threads = checked_threads(threads);
  const int64_t n = g.size();
  float* r = nullptr;
  FloatInPlace res;
  if (!residual.is_none()) {
    res = in_place_arg(residual, "residual");
    if (res.size() != n) throw std::invalid_argument("scan: residual and gradient differ in size");
    r = res.mutable_data();
  }
  const bool select = topk_r > 0 && topk_r < n;
  py::array_t<int64_t> out(select ? topk_r : 0);
  int64_t* o = out.mutable_data();
  dr_select::Scan result;
  {
    py::gil_scoped_release release;
    result = dr_select::scan(g.data(), r, n, select ? topk_r : 0, threads, o);
  }
  if (result == dr_select::Scan::kSelected) return py::make_tuple(true, out);
  return py::make_tuple(result == dr_select::Scan::kFinite, py::none());
}

py::array_t<int64_t> topk(FloatIn x, int64_t r, int threads) {
  threads = checked_threads(threads);
  const int64_t n = x.size();
  if (r <= 0 || r >= n) throw std::invalid_argument("topk: r must satisfy 0 < r < n");
  py::array_t<int64_t> out(r);
  int64_t* o = out.mutable_data();
  {
    py::gil_scoped_release release;
    dr_select::topk(x.data(), n, r, threads, o);
  }
  return out;
}

py::array_t<int64_t> threshold(FloatIn x, float t, int threads) {
  threads = checked_threads(threads);
  std::vector<int64_t> found;
  {
    py::gil_scoped_release release;
    found = dr_select::threshold(x.data(), x.size(), t, threads);
  }
  py::array_t<int64_t> out(static_cast<py::ssize_t>(found.size()));
  if (!found.empty()) std::copy(found.begin(), found.end(), out.mutable_data());
  return out;
}

py::array_t<int64_t> nonzero(FloatIn x, int threads) {
  threads = checked_threads(threads);
  std::vector<int64_t> counts;
  {
    py::gil_scoped_release release;
    counts = dr_select::nonzero_counts(x.data(), x.size(), threads);
  }
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  py::array_t<int64_t> out(total);
  int64_t* o = out.mutable_data();
  {
    py::gil_scoped_release release;
    dr_select::nonzero(x.data(), x.size(), counts, o);
  }
  return out;
}

void check_scatter(const FloatInPlace& out, const IndexIn& idx, const FloatIn& val) {
  if (idx.size() != val.size()) throw std::invalid_argument("scatter_add: indices and values differ in length");
}

void scatter_add(py::object out_obj, py::array idx_obj, FloatIn val, int threads) {
  threads = checked_threads(threads);
  FloatInPlace out = in_place_arg(out_obj, "out");
  IndexIn idx = index_arg(idx_obj, "indices");
  check_scatter(out, idx, val);
  float* o = out.mutable_data();
  std::string error;
  {
    py::gil_scoped_release release;
    error = dr_select::scatter_add_checked(o, out.size(), idx.data(), val.data(), idx.size(), threads);
  }
  if (!error.empty()) throw py::value_error(error);
}

void scatter_add_unchecked(py::object out_obj, py::array idx_obj, FloatIn val, int threads) {
  threads = checked_threads(threads);
  FloatInPlace out = in_place_arg(out_obj, "out");
  IndexIn idx = index_arg(idx_obj, "indices");
  check_scatter(out, idx, val);
  float* o = out.mutable_data();
  const int64_t* ix = idx.data();
  const int64_t n = idx.size(), size = out.size();
  int64_t bad = -1;   // the first index outside [0, size): checked here, so no caller can write out of bounds
  {
    py::gil_scoped_release release;
    for (int64_t j = 0; j < n && bad < 0; ++j)
      if (ix[j] < 0 || ix[j] >= size) bad = j;
    if (bad < 0) dr_select::scatter_add(o, ix, val.data(), n, threads);
  }
  if (bad >= 0)
    throw py::value_error("scatter_add: index " + std::to_string(ix[bad]) + " at " + std::to_string(bad) +
                          " is outside [0, " + std::to_string(size) + ")");
}

// (norms, levels, receiver's values) of qsgd_encode, or None if a bucket norm is not finite.
py::object qsgd_encode(FloatIn values, int levels, int64_t bucket_size, uint64_t seed, int threads) {
  threads = checked_threads(threads);
  if (levels < 1 || levels > 32767) throw std::invalid_argument("qsgd_encode: levels must be in [1, 32767]");
  if (bucket_size < 1) throw std::invalid_argument("qsgd_encode: bucket_size must be >= 1");
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
    finite = dr_select::qsgd_encode(values.data(), n, levels, bucket_size, seed, threads, nu, q8, q16, r);
  }
  if (!finite) return py::none();
  return py::make_tuple(norms, q, recon);
}

}  // namespace

PYBIND11_MODULE(_select, m) {
  m.doc() = "Hot-path kernels of deepreduce: compensation scan, Top-r / threshold / non-zero selection, scatter-add, "
          "QSGD encode";
  m.def("scan", &scan, py::arg("g"), py::arg("residual"), py::arg("topk_r"), py::arg("threads"),
        "(finite, Top-r positions or None); with a residual, residual += g in place (see select.h)");
  m.def("topk", &topk, py::arg("x"), py::arg("r"), py::arg("threads"),
        "ascending positions of the r largest |x| (ties: lowest position first)");
  m.def("threshold", &threshold, py::arg("x"), py::arg("t"), py::arg("threads"), "ascending j with |x_j| >= t");
  m.def("nonzero", &nonzero, py::arg("x"), py::arg("threads"),
        "ascending int64 positions of the non-zero entries (as numpy.flatnonzero)");
  m.def("scatter_add", &scatter_add, py::arg("out"), py::arg("indices"), py::arg("values"), py::arg("threads"),
        "out[indices] += values for strictly ascending in-range indices (ValueError otherwise)");
  m.def("scatter_add_unchecked", &scatter_add_unchecked, py::arg("out"), py::arg("indices"), py::arg("values"),
        py::arg("threads"), "out[indices] += values for distinct indices in any order (the range is checked: "
        "ValueError, nothing written; distinctness is the caller's)");
  m.def("qsgd_encode", &qsgd_encode, py::arg("values"), py::arg("levels"), py::arg("bucket_size"), py::arg("seed"),
        py::arg("threads"), "(float32 bucket norms, int8/int16 levels, float32 receiver's values) of QSGD, "
        "or None if a bucket norm is not finite (deepreduce/values/qsgd.py, the same bytes)");
}
