// pybind11 binding of the container header code (container.h) and the bit packing (bitpack.h):
// deepreduce._container. deepreduce/wire/container.py and bitpack.py call it when it is built (the
// TF ops use the same functions); parse errors come back as ValueError carrying container.py's
// ContainerError text, a shape the receiver did not expect as CommunicationError.
#include <string>

#include "bitpack.h"
#include "common/py_args.h"
#include "container.h"

namespace py = pybind11;
namespace ct = deepreduce::container;
using deepreduce::py_args::Bytes;
using deepreduce::py_args::bytes_arg;

namespace {

py::array_t<uint8_t> pack(int flags, int index_id, int value_id, int perm_width, const py::bytes& digest, uint64_t n,
                          const py::tuple& shape, const py::buffer& index_params, const py::buffer& value_params,
                          const py::buffer& index_section, const py::buffer& value_section,
                          const py::buffer& perm_section) {
    ct::Header h;
    h.flags = static_cast<uint8_t>(flags);
    h.index_id = static_cast<uint8_t>(index_id);
    h.value_id = static_cast<uint8_t>(value_id);
    h.perm_width = static_cast<uint8_t>(perm_width);
    const std::string d = digest;
    if (d.size() != ct::DIGEST_SIZE) throw py::value_error("digest must have 8 bytes");
    std::copy(d.begin(), d.end(), h.digest);
    h.n = n;
    if (shape.size() > ct::MAX_NDIM) throw py::value_error("too many dimensions");
    for (const auto& s : shape) h.shape.push_back(s.cast<uint64_t>());
    py::buffer_info infos[5];
    const py::buffer* buffers[5] = {&index_params, &value_params, &index_section, &value_section, &perm_section};
    const char* names[5] = {"index_params", "value_params", "index_section", "value_section", "perm_section"};
    const uint8_t* data[5];
    uint64_t len[5];
    for (int s = 0; s < 5; ++s) {
        const Bytes b = bytes_arg(*buffers[s], infos[s], names[s]);
        data[s] = b.data;
        len[s] = b.size;
    }
    std::vector<uint8_t> out;
    {
        py::gil_scoped_release release;
        ct::pack(h, data, len, out);
    }
    py::array_t<uint8_t> arr(static_cast<py::ssize_t>(out.size()));
    std::copy(out.begin(), out.end(), arr.mutable_data());
    return arr;
}

// (version, flags, index id, value id, perm width, digest or None, n, (Pi, Pv, Li, Lv, Lp), shape),
// checked in container.unpack's order, the receiver's bounds (expected shape or max_numel) included.
py::tuple unpack_header(const py::buffer& buf, const py::object& expected_shape, uint64_t max_numel) {
    py::buffer_info info;
    const Bytes b = bytes_arg(buf, info, "buffer");
    std::vector<uint64_t> expected;
    const bool check_shape = !expected_shape.is_none();
    if (check_shape)
        for (const auto& s : expected_shape) expected.push_back(s.cast<uint64_t>());
    ct::Header h;
    ct::unpack(b.data, b.size, h, check_shape ? &expected : nullptr, max_numel);
    py::tuple lengths(5);
    for (int s = 0; s < 5; ++s) lengths[s] = py::int_(h.lengths[s]);
    py::tuple shape(h.shape.size());
    for (size_t a = 0; a < h.shape.size(); ++a) shape[a] = py::int_(h.shape[a]);
    py::object digest = h.has_digest ? py::object(py::bytes(reinterpret_cast<const char*>(h.digest), ct::DIGEST_SIZE))
                                     : py::object(py::none());
    return py::make_tuple(h.version, h.flags, h.index_id, h.value_id, h.perm_width, digest, h.n, lengths, shape);
}

uint32_t crc32(const py::buffer& buf) {
    py::buffer_info info;
    const Bytes b = bytes_arg(buf, info, "data");
    return ct::crc32(b.data, b.size);
}

// bitpack.pack of a contiguous uint64 array (values below 2^width: the caller checked them).
py::bytes bit_pack(const py::array_t<uint64_t, py::array::c_style>& values, int width) {
    if (width < 1 || width > 64) throw py::value_error("bit width must be in [1, 64], got " + std::to_string(width));
    const uint64_t count = static_cast<uint64_t>(values.size());
    std::string out(deepreduce::bitpack::packed_size(count, width), '\0');
    const uint64_t* v = values.data();
    {
        py::gil_scoped_release release;
        deepreduce::bitpack::pack(v, count, width, reinterpret_cast<uint8_t*>(&out[0]));
    }
    return py::bytes(out);
}

// bitpack.unpack: uint64 entries, or ValueError with the ContainerError text.
py::array_t<uint64_t> bit_unpack(const py::buffer& data, int width, uint64_t count) {
    py::buffer_info info;
    const Bytes b = bytes_arg(data, info, "data");
    deepreduce::bitpack::check(b.size, width, count);  // before sizing the output from count
    py::array_t<uint64_t> out(static_cast<py::ssize_t>(count));
    uint64_t* o = out.mutable_data();
    py::gil_scoped_release release;
    deepreduce::bitpack::unpack(b.data, b.size, width, count, o);
    return out;
}

}  // namespace

PYBIND11_MODULE(_container, m) {
    deepreduce::py_args::register_errors();
    m.doc() = "Container format v2 header packing and v1/v2 parsing in C++ (the code the TF ops use)";
    m.def("pack", &pack, py::arg("flags"), py::arg("index_id"), py::arg("value_id"), py::arg("perm_width"),
          py::arg("digest"), py::arg("n"), py::arg("shape"), py::arg("index_params"), py::arg("value_params"),
          py::arg("index_section"), py::arg("value_section"), py::arg("perm_section"),
          "one v2 container (1-D uint8 array) from its header fields and sections");
    m.def("unpack_header", &unpack_header, py::arg("buffer"), py::arg("expected_shape") = py::none(),
          py::arg("max_numel") = ~uint64_t(0),
          "the checked header of one container (ValueError with container.unpack's message otherwise, "
          "CommunicationError for another shape than expected_shape)");
    m.def("crc32", &crc32, py::arg("data"), "zlib's CRC-32");
    m.def("bit_pack", &bit_pack, py::arg("values"), py::arg("width"),
          "bitpack.pack of uint64 values below 2**width (bytes)");
    m.def("bit_unpack", &bit_unpack, py::arg("data"), py::arg("width"), py::arg("count"),
          "bitpack.unpack (uint64 array); ValueError with the ContainerError text for a wrong width or length");
}
