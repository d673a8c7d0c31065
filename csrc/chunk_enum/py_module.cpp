// pybind11 binding of the chunk_enum index section: deepreduce._chunk_enum (see chunk_enum.h).
// Offsets, counts and chunk lengths in as 1-D integer arrays (int64), the section as bytes; the
// GIL is released while a section is written or read. Arguments that do not describe one set
// of chunks raise ValueError before any kernel runs; a section no encoder writes raises
// ValueError with the Python codec's text (the codec re-raises it as ContainerError).
#include <numeric>
#include <string>

#include "chunk_enum.h"
#include "common/py_args.h"

namespace py = pybind11;
namespace ce = deepreduce::chunk_enum;
using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

namespace {

constexpr uint64_t MAX_TABLE_ENTRIES = uint64_t{1} << 32;

struct Geometry {
    I64 counts, lengths;
    int64_t chunks = 0, indices = 0, table_entries = 0;
};

Geometry geometry(const py::array& counts, const py::array& lengths, const py::handle& table_entries) {
    Geometry g;
    g.counts = deepreduce::py_args::position_array(counts, "counts");
    g.lengths = deepreduce::py_args::position_array(lengths, "lengths");
    if (g.counts.ndim() != 1 || g.lengths.ndim() != 1 || g.counts.size() != g.lengths.size())
        throw py::value_error("chunk_enum: counts and lengths must be 1-D arrays of one size");
    g.chunks = g.counts.size();
    g.table_entries =
        static_cast<int64_t>(deepreduce::py_args::int_arg(table_entries, "table_entries", 1, MAX_TABLE_ENTRIES));
    const int64_t* c = g.counts.data();
    const int64_t* l = g.lengths.data();
    for (int64_t j = 0; j < g.chunks; ++j) {
        if (l[j] < 1 || c[j] < 0 || c[j] > l[j])
            throw py::value_error("chunk_enum: chunk " + std::to_string(j) + " of " + std::to_string(l[j]) +
                                  " elements cannot hold " + std::to_string(c[j]) + " indices");
        g.indices += c[j];
    }
    return g;
}

py::bytes pack(const py::array& local, const py::array& counts, const py::array& lengths,
               const py::handle& table_entries, const py::handle& threads) {
    Geometry g = geometry(counts, lengths, table_entries);
    const int t = deepreduce::py_args::threads_arg(threads);
    I64 offsets = deepreduce::py_args::position_array(local, "local");
    if (offsets.ndim() != 1 || offsets.size() != g.indices)
        throw py::value_error("chunk_enum: " + std::to_string(offsets.size()) + " offsets for counts summing to " +
                              std::to_string(g.indices));
    std::vector<uint8_t> out;
    {
        py::gil_scoped_release release;
        out = ce::pack(offsets.data(), g.counts.data(), g.lengths.data(), g.chunks, g.table_entries, t);
    }
    return py::bytes(reinterpret_cast<const char*>(out.data()), out.size());
}

I64 unpack(const py::buffer& section, const py::array& counts, const py::array& lengths,
           const py::handle& table_entries, const py::handle& threads) {
    Geometry g = geometry(counts, lengths, table_entries);
    const int t = deepreduce::py_args::threads_arg(threads);
    py::buffer_info info;
    const auto bytes = deepreduce::py_args::bytes_arg(section, info, "section");
    I64 out(g.indices);
    {
        py::gil_scoped_release release;
        ce::unpack(bytes.data, bytes.size, g.counts.data(), g.lengths.data(), g.chunks, g.table_entries, t,
                   out.mutable_data());
    }
    return out;
}

py::tuple layout(int64_t length, int64_t count, const py::handle& table_entries) {
    const auto entries =
        static_cast<int64_t>(deepreduce::py_args::int_arg(table_entries, "table_entries", 1, MAX_TABLE_ENTRIES));
    if (length < 1 || count < 0 || count > length)
        throw py::value_error("chunk_enum: a chunk of " + std::to_string(length) + " elements cannot hold " +
                              std::to_string(count) + " indices");
    const ce::Layout lay = ce::layout(length, count, entries);
    return py::make_tuple(static_cast<int>(lay.mode), lay.bits, lay.ranked);
}

}  // namespace

PYBIND11_MODULE(_chunk_enum, m) {
    deepreduce::py_args::register_errors();
    m.doc() = "chunk_enum index sections (deepreduce/index/chunk_enum.py) in C++";
    m.def("pack", &pack, py::arg("local"), py::arg("counts"), py::arg("lengths"), py::arg("table_entries"),
          py::arg("threads") = 1, "the section of chunk-local offsets (ascending in each chunk) as bytes");
    m.def("unpack", &unpack, py::arg("section"), py::arg("counts"), py::arg("lengths"), py::arg("table_entries"),
          py::arg("threads") = 1, "the int64 chunk-local offsets of a section; ValueError for one no encoder writes");
    m.def("layout", &layout, py::arg("length"), py::arg("count"), py::arg("table_entries"),
          "(mode, bits, ranked) of a chunk, as chunk_enum.layout");
}
