// The argument checks of every pybind11 module (csrc/*/py_module.cpp): Python objects in, checked
// C++ values out, before any kernel runs. Integers must be Python/NumPy integers in range
// (TypeError for anything else, a float included; ValueError out of range, with checks.h's
// message), index arrays 1-D integer arrays (a float array raises instead of being truncated),
// in-place outputs writeable C-contiguous float32 arrays (never converted: a copy would lose
// the write), byte arguments contiguous buffers.
//
// Errors: deepreduce::Error (error.h) reaches Python as ValueError, its COMMUNICATION and
// OVERFLOW kinds as deepreduce.errors.CommunicationError and NonFiniteGradientError
// (register_errors, called by every module).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <new>
#include <string>

#include "common/checks.h"
#include "common/error.h"

namespace deepreduce {
namespace py_args {

namespace py = pybind11;

using U64Array = py::array_t<uint64_t, py::array::c_style>;
using I64Array = py::array_t<int64_t, py::array::c_style>;
using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;
using FloatInPlace = py::array_t<float, py::array::c_style>;

// Raise deepreduce::Error as ValueError, or as the deepreduce.errors class its COMMUNICATION or
// OVERFLOW kind names; std::bad_alloc (memory a kernel could not get) as
// deepreduce.errors.DeepReduceError, never as a bare MemoryError.
inline void register_errors() {
    py::register_local_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const Error& e) {
            if (e.kind() != ErrorKind::COMMUNICATION && e.kind() != ErrorKind::OVERFLOW) {
                PyErr_SetString(PyExc_ValueError, e.what());
                return;
            }
            py::object cls = py::module_::import("deepreduce.errors").attr(e.kind_name());
            PyErr_SetString(cls.ptr(), e.what());
        } catch (const std::bad_alloc&) {
            py::object cls = py::module_::import("deepreduce.errors").attr("DeepReduceError");
            PyErr_SetString(cls.ptr(), "out of memory in a deepreduce C++ kernel (std::bad_alloc)");
        }
    });
}

// An integer argument in [lo, hi].
inline uint64_t int_arg(const py::handle& obj, const char* name, uint64_t lo, uint64_t hi) {
    if (py::isinstance<py::bool_>(obj) || !PyIndex_Check(obj.ptr()))
        throw py::type_error(std::string(name) + " must be an integer, got " +
                             std::string(py::str(py::type::of(obj).attr("__name__"))));
    py::int_ value = py::reinterpret_steal<py::int_>(PyNumber_Index(obj.ptr()));
    if (!value) throw py::error_already_set();
    const bool below = PyObject_RichCompareBool(value.ptr(), py::int_(lo).ptr(), Py_LT) == 1;
    const bool above = PyObject_RichCompareBool(value.ptr(), py::int_(hi).ptr(), Py_GT) == 1;
    if (below || above)  // the text of check_range, for values beyond 64 bits too
        throw py::value_error(std::string(name) + " = " + std::string(py::str(value)) + " is outside [" +
                              std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return PyLong_AsUnsignedLongLong(value.ptr());
}

inline int threads_arg(const py::handle& obj) {
    return static_cast<int>(int_arg(obj, "threads", 1, MAX_THREADS));
}

// A 1-D array of non-negative integers, as contiguous uint64.
inline U64Array index_array(const py::handle& obj, const char* name) {
    py::array arr = py::array::ensure(obj);
    if (!arr) throw py::type_error(std::string(name) + " must be an array of integers");
    const char kind = arr.dtype().kind();
    if (kind != 'i' && kind != 'u')
        throw py::type_error(std::string(name) + " must be an integer array, got dtype " +
                             std::string(py::str(arr.dtype())));
    if (arr.ndim() != 1)
        throw py::value_error(std::string(name) + " must be 1-D, got " + std::to_string(arr.ndim()) + " dimensions");
    if (kind == 'i') {
        py::array_t<int64_t, py::array::c_style | py::array::forcecast> as_signed(arr);
        const int64_t* p = as_signed.data();
        for (py::ssize_t a = 0; a < as_signed.size(); ++a)
            if (p[a] < 0)
                throw py::value_error(std::string(name) + " must be non-negative, got " + std::to_string(p[a]));
    }
    return py::array_t < uint64_t, py::array::c_style | py::array::forcecast > (arr);
}

// An array of signed positions, as contiguous int64 (integer dtypes only; the kernel checks ranges).
inline I64Array position_array(const py::array& arr, const char* name) {
    const char kind = arr.dtype().kind();
    if (kind != 'i' && kind != 'u')
        throw py::type_error(std::string(name) + " must be an integer array, got dtype " +
                             std::string(py::str(arr.dtype())));
    return py::array_t < int64_t, py::array::c_style | py::array::forcecast > ::ensure(arr);
}

// An in-place float32 argument, checked rather than converted.
inline FloatInPlace in_place_array(const py::handle& obj, const char* name) {
    if (!FloatInPlace::check_(obj) || !py::cast<py::array>(obj).writeable())
        throw py::type_error(std::string(name) + " must be a writeable C-contiguous float32 array");
    return py::reinterpret_borrow<FloatInPlace>(obj);
}

// The bytes of a contiguous buffer argument (bytes, bytearray, 1-D contiguous array); `info`
// keeps the buffer alive while the view is used.
struct Bytes {
    const uint8_t* data;
    size_t size;
};

inline Bytes bytes_arg(const py::buffer& b, py::buffer_info& info, const char* name) {
    info = b.request();
    if (info.ndim > 1 || (info.ndim == 1 && info.strides[0] != info.itemsize))
        throw py::value_error(std::string(name) + " must be bytes or a contiguous 1-D array");
    return {static_cast<const uint8_t*>(info.ptr), static_cast<size_t>(info.size * info.itemsize)};
}

}  // namespace py_args
}  // namespace deepreduce
