// Container format v2 (written) and v1 (read) in C++: header packing and parsing, varints and
// the CRC-32, over plain buffers. The pybind11 module deepreduce._container (py_module.cpp) and
// the TensorFlow ops (csrc/tf) use these functions; deepreduce/wire/container.py is the Python twin
// (docs/container-format.md has the byte tables; tests compare both byte for byte).
//
// v2 layout (little-endian):
//   0  magic "DPRD" | 4 version (2) | 5 flags | 6 index id | 7 value id | 8 ndim | 9 perm width
//   10 config digest (8 bytes) | 18 varints n, Pi, Pv, Li, Lv, Lp, shape[0..ndim)
//   then index params, value params, index section, value section, permutation section,
//   and the CRC-32 (zlib polynomial) of every byte before it.
// v1: the same first 10 bytes, then u16 Pi, Pv, reserved, u64 n, Li, Lv, Lp, then u64 dims.
//
// Parsing never reads out of bounds; a bad buffer throws deepreduce::Error (common/error.h) with
// the text of container.py's ContainerError (CommunicationError for a shape the receiver did not
// expect).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace deepreduce {
namespace container {

constexpr uint8_t VERSION = 2;
constexpr uint8_t FLAG_DENSE = 0x01;
constexpr uint8_t FLAG_PERMUTED = 0x02;
constexpr uint8_t FLAG_NONFINITE = 0x04;
constexpr uint8_t KNOWN_FLAGS = FLAG_DENSE | FLAG_PERMUTED | FLAG_NONFINITE;
constexpr size_t MAX_NDIM = 32;
constexpr uint64_t MAX_PARAMS = 0xFFFF;
constexpr size_t DIGEST_SIZE = 8;
constexpr size_t CRC_SIZE = 4;
constexpr size_t V1_FIXED = 48;
constexpr size_t V2_FIXED = 18;
constexpr int VARINT_MAX_BYTES = 10;
// container.MAX_TENSOR_NUMEL: no tensor has more elements (NumPy, torch and TensorFlow refuse or
// abort on shapes whose byte size or strides reach 2^63); it also bounds the product of the
// non-zero dimensions of a 0-element tensor.
constexpr uint64_t MAX_TENSOR_NUMEL = uint64_t(1) << 60;

// zlib's CRC-32 of n bytes, continuing from `crc` (0 to start).
uint32_t crc32(const uint8_t* data, size_t n, uint32_t crc = 0);

// Bytes the unsigned LEB128 varint of v takes; write it at out, returning the end.
size_t varint_size(uint64_t v);
uint8_t* varint_put(uint8_t* out, uint64_t v);

// varint.decode: the varint at buf[pos] (len bounds the read), pos moved past it; the error
// names `field`.
uint64_t varint_get(const uint8_t* buf, size_t len, size_t& pos, const std::string& field);

// Index of the sections in Header::lengths (and of the params before them).
enum Section { INDEX_PARAMS = 0, VALUE_PARAMS = 1, INDEX = 2, VALUE = 3, PERM = 4 };

struct Header {
    uint8_t version = VERSION;
    uint8_t flags = 0;
    uint8_t index_id = 0;
    uint8_t value_id = 0;
    uint8_t perm_width = 0;
    bool has_digest = true;  // false for v1 (no digest field)
    uint8_t digest[DIGEST_SIZE] = {};
    uint16_t reserved = 0;  // v1 only
    uint64_t n = 0;
    uint64_t lengths[5] = {};  // Pi, Pv, Li, Lv, Lp
    std::vector<uint64_t> shape;
    size_t size = 0;  // header bytes before the index params (set by parse / write)

    bool dense() const { return flags & FLAG_DENSE; }
    bool permuted() const { return flags & FLAG_PERMUTED; }
    // Bytes of the whole container: header, params, sections, CRC.
    uint64_t total() const;
};

// Bytes a v2 header of h takes (before the index params); h.lengths and h.shape must be set.
size_t header_size(const Header& h);

// Write the v2 header of h at out (header_size(h) bytes); returns the bytes written. The caller
// then writes params and sections after it and calls finish() on the whole container.
size_t write_header(const Header& h, uint8_t* out);

// Write the CRC of the first total - 4 bytes into the last 4 bytes of a container.
void finish(uint8_t* container, size_t total);

// A whole v2 container from a header (lengths are taken from the sections) and its five byte
// ranges (params and sections in the order of Section), appended to out.
void pack(Header h, const uint8_t* const data[5], const uint64_t len[5], std::vector<uint8_t>& out);

// The header of the container that starts at buf[offset] (either version) into h.
void read_header(const uint8_t* buf, size_t len, size_t offset, Header& h);

// Parse and check one container of exactly len bytes (container.unpack's checks, check_size
// included) into h; returns numel, the product of its shape. With `expected`, a header of
// another shape is refused (ErrorKind::COMMUNICATION); without, one claiming more than
// max_numel elements, or, for a 0-element tensor, one whose non-zero dimensions multiply to more
// than max_numel (max_numel is capped at MAX_TENSOR_NUMEL in both cases).
uint64_t unpack(const uint8_t* buf, size_t len, Header& h, const std::vector<uint64_t>* expected = nullptr,
                uint64_t max_numel = ~uint64_t(0));

// (offset, length) of every container in a concatenation (container.split).
std::vector<std::pair<size_t, size_t>> split(const uint8_t* buf, size_t len);

// The shape as Python prints a tuple: "(3, 4)", "(8000,)", "()".
std::string shape_string(const std::vector<uint64_t>& shape);

}  // namespace container
}  // namespace deepreduce
