// Container format v2/v1 header packing and parsing (see container.h).
#include "container.h"

#include <cstring>

#include "common/error.h"

namespace deepreduce {
namespace container {

namespace {

const uint8_t MAGIC[4] = {'D', 'P', 'R', 'D'};
const char* const LENGTH_FIELDS[5] = {"index params length", "value params length", "index section length",
                                      "value section length", "permutation section length"};

// Slicing-by-8 tables of the reflected CRC-32 polynomial 0xEDB88320 (zlib's crc32).
struct CrcTables {
    uint32_t t[8][256];
    CrcTables() {
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int b = 0; b < 8; ++b) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
            t[0][i] = c;
        }
        for (uint32_t i = 0; i < 256; ++i)
            for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
};

const CrcTables& crc_tables() {
    static const CrcTables tables;
    return tables;
}

uint64_t le(const uint8_t* p, int bytes) {
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

void put_le(uint8_t* p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i, v >>= 8) p[i] = static_cast<uint8_t>(v);
}

std::string u128_string(unsigned __int128 v) {
    if (v == 0) return "0";
    std::string s;
    while (v) {
        s.insert(s.begin(), static_cast<char>('0' + static_cast<int>(v % 10)));
        v /= 10;
    }
    return s;
}

// The exact product of the dimensions in decimal (for messages about shapes beyond 2^64 elements).
std::string product_string(const std::vector<uint64_t>& shape) {
    std::vector<uint32_t> digits{1};  // base 1e9, least significant first
    for (uint64_t s : shape) {
        const uint64_t parts[3] = {s % 1000000000ULL, (s / 1000000000ULL) % 1000000000ULL, s / 1000000000000000000ULL};
        std::vector<uint64_t> acc(digits.size() + 3, 0);
        for (size_t i = 0; i < digits.size(); ++i) {
            for (int j = 0; j < 3; ++j) {
                const uint64_t product = static_cast<uint64_t>(digits[i]) * parts[j];  // < 1e18
                acc[i + j] += product % 1000000000ULL;
                acc[i + j + 1] += product / 1000000000ULL;
            }
        }
        digits.assign(acc.size() + 1, 0);
        uint64_t carry = 0;
        for (size_t i = 0; i < acc.size(); ++i) {
            const uint64_t v = acc[i] + carry;
            digits[i] = static_cast<uint32_t>(v % 1000000000ULL);
            carry = v / 1000000000ULL;
        }
        digits[acc.size()] = static_cast<uint32_t>(carry);
        while (digits.size() > 1 && digits.back() == 0) digits.pop_back();
    }
    std::string out = std::to_string(digits.back());
    for (size_t i = digits.size() - 1; i-- > 0;) {
        std::string part = std::to_string(digits[i]);
        out += std::string(9 - part.size(), '0') + part;
    }
    return out;
}

// Python's repr of a bytes object (b'DPRD', b"D'RD", b'\x00\x01...'): quoted with " when the
// bytes hold a ' and no ", else with ', escaping only the quote in use and the backslash.
std::string bytes_repr(const uint8_t* p, size_t n) {
    static const char* hex = "0123456789abcdef";
    const bool has_single = std::memchr(p, '\'', n) != nullptr;
    const bool has_double = std::memchr(p, '"', n) != nullptr;
    const char quote = has_single && !has_double ? '"' : '\'';
    std::string s = "b";
    s += quote;
    for (size_t i = 0; i < n; ++i) {
        const uint8_t c = p[i];
        if (c == '\\' || c == static_cast<uint8_t>(quote)) {
            s += '\\';
            s += static_cast<char>(c);
        } else if (c == '\t') {
            s += "\\t";
        } else if (c == '\n') {
            s += "\\n";
        } else if (c == '\r') {
            s += "\\r";
        } else if (c < 0x20 || c >= 0x7F) {
            s += "\\x";
            s += hex[c >> 4];
            s += hex[c & 15];
        } else {
            s += static_cast<char>(c);
        }
    }
    return s + quote;
}

unsigned __int128 total128(const Header& h) {
    unsigned __int128 t = h.size + CRC_SIZE;
    for (uint64_t l : h.lengths) t += l;
    return t;
}

}  // namespace

uint32_t crc32(const uint8_t* data, size_t n, uint32_t crc) {
    const auto& T = crc_tables().t;
    uint32_t c = ~crc;
    while (n >= 8) {
        const uint32_t lo = c ^ static_cast<uint32_t>(le(data, 4));
        const uint32_t hi = static_cast<uint32_t>(le(data + 4, 4));
        c = T[7][lo & 0xFF] ^ T[6][(lo >> 8) & 0xFF] ^ T[5][(lo >> 16) & 0xFF] ^ T[4][lo >> 24] ^ T[3][hi & 0xFF] ^
            T[2][(hi >> 8) & 0xFF] ^ T[1][(hi >> 16) & 0xFF] ^ T[0][hi >> 24];
        data += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ T[0][(c ^ *data++) & 0xFF];
    return ~c;
}

size_t varint_size(uint64_t v) {
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        ++n;
    }
    return n;
}

uint8_t* varint_put(uint8_t* out, uint64_t v) {
    while (v >= 0x80) {
        *out++ = static_cast<uint8_t>((v & 0x7F) | 0x80);
        v >>= 7;
    }
    *out++ = static_cast<uint8_t>(v);
    return out;
}

uint64_t varint_get(const uint8_t* buf, size_t len, size_t& pos, const std::string& field) {
    const size_t start = pos;
    uint64_t value = 0;
    int shift = 0;
    uint8_t byte = 0;
    bool overflow = false;
    while (true) {
        if (pos >= len)
            fail(ErrorKind::CONTAINER,
                 "truncated container: field " + field + " runs past the end at byte " + std::to_string(pos));
        byte = buf[pos++];
        const uint64_t group = byte & 0x7F;
        if (shift == 63 && group > 1) overflow = true;  // reported once the varint ends, as varint.py does
        value |= group << shift;
        if (!(byte & 0x80)) break;
        shift += 7;
        if (pos - start >= static_cast<size_t>(VARINT_MAX_BYTES))
            fail(ErrorKind::CONTAINER, "container field " + field + " at byte " + std::to_string(start) +
                                           " is longer than " + std::to_string(VARINT_MAX_BYTES) + " bytes");
    }
    if (overflow)
        fail(ErrorKind::CONTAINER,
             "container field " + field + " at byte " + std::to_string(start) + " exceeds 2**64 - 1");
    if (byte == 0 && pos - start > 1)
        fail(ErrorKind::CONTAINER,
             "container field " + field + " at byte " + std::to_string(start) + " is not in its shortest form");
    return value;
}

uint64_t Header::total() const {
    const unsigned __int128 t = total128(*this);
    return t > ~uint64_t(0) ? ~uint64_t(0) : static_cast<uint64_t>(t);
}

size_t header_size(const Header& h) {
    size_t size = V2_FIXED + varint_size(h.n);
    for (uint64_t l : h.lengths) size += varint_size(l);
    for (uint64_t s : h.shape) size += varint_size(s);
    return size;
}

size_t write_header(const Header& h, uint8_t* out) {
    std::memcpy(out, MAGIC, 4);
    out[4] = VERSION;
    out[5] = h.flags;
    out[6] = h.index_id;
    out[7] = h.value_id;
    out[8] = static_cast<uint8_t>(h.shape.size());
    out[9] = h.perm_width;
    std::memcpy(out + 10, h.digest, DIGEST_SIZE);
    uint8_t* p = varint_put(out + V2_FIXED, h.n);
    for (uint64_t l : h.lengths) p = varint_put(p, l);
    for (uint64_t s : h.shape) p = varint_put(p, s);
    return static_cast<size_t>(p - out);
}

void finish(uint8_t* c, size_t total) {
    put_le(c + total - CRC_SIZE, crc32(c, total - CRC_SIZE), 4);
}

void pack(Header h, const uint8_t* const data[5], const uint64_t len[5], std::vector<uint8_t>& out) {
    for (int s = 0; s < 5; ++s) h.lengths[s] = len[s];
    const size_t start = out.size();
    const size_t hs = header_size(h);
    out.resize(start + static_cast<size_t>(hs + len[0] + len[1] + len[2] + len[3] + len[4] + CRC_SIZE));
    uint8_t* p = out.data() + start;
    size_t pos = write_header(h, p);
    for (int s = 0; s < 5; ++s) {
        if (len[s]) std::memcpy(p + pos, data[s], len[s]);
        pos += len[s];
    }
    finish(p, pos + CRC_SIZE);
}

void read_header(const uint8_t* buf, size_t len, size_t offset, Header& h) {
    const std::string at = std::to_string(offset);
    const size_t left = len - offset;
    if (left < 5 + CRC_SIZE)
        fail(ErrorKind::CONTAINER, "truncated container at byte " + at + ": " + std::to_string(left) + " bytes");
    const uint8_t* p = buf + offset;
    if (std::memcmp(p, MAGIC, 4) != 0)
        fail(ErrorKind::CONTAINER,
             "not a deepreduce container at byte " + at + ": magic " + bytes_repr(p, 4) + ", expected b'DPRD'");
    h.version = p[4];
    if (h.version != 1 && h.version != 2)
        fail(ErrorKind::CONTAINER, "container format version " + std::to_string(h.version) +
                                       " is not supported (this build reads versions 1 and 2)");
    const size_t fixed = h.version == 1 ? V1_FIXED : V2_FIXED;
    if (left < fixed + CRC_SIZE)
        fail(ErrorKind::CONTAINER, "truncated container at byte " + at + ": " + std::to_string(left) +
                                       " bytes, the version " + std::to_string(h.version) + " header alone needs " +
                                       std::to_string(fixed + CRC_SIZE));
    h.flags = p[5];
    h.index_id = p[6];
    h.value_id = p[7];
    const size_t ndim = p[8];
    h.perm_width = p[9];
    if (ndim > MAX_NDIM)
        fail(ErrorKind::CONTAINER,
             "container claims " + std::to_string(ndim) + " dimensions; at most " + std::to_string(MAX_NDIM));
    h.shape.assign(ndim, 0);
    size_t pos = offset + fixed;
    if (h.version == 1) {
        h.has_digest = false;
        h.lengths[0] = le(p + 10, 2);
        h.lengths[1] = le(p + 12, 2);
        h.reserved = static_cast<uint16_t>(le(p + 14, 2));
        h.n = le(p + 16, 8);
        for (int s = 2; s < 5; ++s) h.lengths[s] = le(p + 24 + 8 * (s - 2), 8);
        if (len - pos < 8 * ndim)
            fail(ErrorKind::CONTAINER, "truncated container at byte " + at + ": the shape runs past the end");
        for (size_t a = 0; a < ndim; ++a) h.shape[a] = le(buf + pos + 8 * a, 8);
        pos += 8 * ndim;
    } else {
        h.has_digest = true;
        h.reserved = 0;
        std::memcpy(h.digest, p + 10, DIGEST_SIZE);
        h.n = varint_get(buf, len, pos, "n");
        for (int s = 0; s < 5; ++s) h.lengths[s] = varint_get(buf, len, pos, LENGTH_FIELDS[s]);
        for (size_t a = 0; a < ndim; ++a) h.shape[a] = varint_get(buf, len, pos, "shape[" + std::to_string(a) + "]");
        for (int s = 0; s < 2; ++s)
            if (h.lengths[s] > MAX_PARAMS)
                fail(ErrorKind::CONTAINER, std::string("container ") + LENGTH_FIELDS[s] + " is " +
                                               std::to_string(h.lengths[s]) + "; at most " +
                                               std::to_string(MAX_PARAMS));
    }
    h.size = pos - offset;
}

uint64_t unpack(const uint8_t* buf, size_t len, Header& h, const std::vector<uint64_t>* expected, uint64_t max_numel) {
    read_header(buf, len, 0, h);
    const unsigned __int128 total = total128(h);
    if (total != len)
        fail(ErrorKind::CONTAINER, "container length mismatch: header describes " + u128_string(total) +
                                       " bytes, buffer has " + std::to_string(len));
    if (crc32(buf, len - CRC_SIZE) != static_cast<uint32_t>(le(buf + len - CRC_SIZE, 4)))
        fail(ErrorKind::CONTAINER, "container checksum mismatch: the buffer is corrupted");
    if ((h.flags & ~KNOWN_FLAGS) || h.reserved) {
        static const char* hex = "0123456789abcdef";
        fail(ErrorKind::CONTAINER, std::string("container has unknown flags 0x") + hex[h.flags >> 4] +
                                       hex[h.flags & 15] + " or non-zero reserved bits");
    }
    // container.check_size
    const unsigned __int128 cap = static_cast<unsigned __int128>(1) << 64;  // beyond it: saturate
    unsigned __int128 count = 1, extent = 1;  // extent: the product of the non-zero dimensions
    std::vector<uint64_t> nonzero;
    for (uint64_t s : h.shape) {
        count = count == 0 || s == 0 ? 0 : (count * s > cap ? cap : count * s);
        if (s) extent = extent * s > cap ? cap : extent * s;
        if (s) nonzero.push_back(s);
    }
    if (max_numel > MAX_TENSOR_NUMEL) max_numel = MAX_TENSOR_NUMEL;
    if (expected) {
        if (h.shape != *expected)
            fail(ErrorKind::COMMUNICATION, "container holds a tensor of shape " + shape_string(h.shape) +
                                               ", expected " + shape_string(*expected) +
                                               ": ranks disagree about this tensor");
    } else if (count > max_numel) {
        fail(ErrorKind::CONTAINER, "container claims a tensor of shape " + shape_string(h.shape) + " (" +
                                       product_string(h.shape) + " elements), above max_numel = " +
                                       std::to_string(max_numel) + "; pass the expected shape or raise max_numel");
    } else if (extent > max_numel) {
        fail(ErrorKind::CONTAINER, "container claims a 0-element tensor of shape " + shape_string(h.shape) +
                                       " whose non-zero dimensions multiply to " + product_string(nonzero) +
                                       ", above max_numel = " + std::to_string(max_numel) +
                                       "; no framework holds such a shape");
    }
    if (count >= cap)
        fail(ErrorKind::CONTAINER, "container shape " + shape_string(h.shape) + " has 2**64 elements or more");
    const uint64_t numel = static_cast<uint64_t>(count);
    if (h.n > numel)
        fail(ErrorKind::CONTAINER, "container claims " + std::to_string(h.n) + " values for a tensor of " +
                                       std::to_string(numel) + " elements");
    if (h.permuted() != (h.perm_width > 0) || (!h.permuted() && h.lengths[PERM]))
        fail(ErrorKind::CONTAINER, "container permutation flag, width and section disagree");
    if (h.dense() && (h.n != numel || static_cast<unsigned __int128>(h.lengths[VALUE]) != 4 * count ||
                      h.lengths[INDEX] || h.lengths[PERM]))
        fail(ErrorKind::CONTAINER, "dense container sections do not match its shape");
    return numel;
}

std::vector<std::pair<size_t, size_t>> split(const uint8_t* buf, size_t len) {
    std::vector<std::pair<size_t, size_t>> parts;
    size_t offset = 0;
    while (offset < len) {
        Header h;
        read_header(buf, len, offset, h);
        const unsigned __int128 total = total128(h);
        if (offset + total > len)
            fail(ErrorKind::CONTAINER, "truncated container at byte " + std::to_string(offset) + ": needs " +
                                           u128_string(total) + " bytes, " + std::to_string(len - offset) + " remain");
        parts.emplace_back(offset, static_cast<size_t>(total));
        offset += static_cast<size_t>(total);
    }
    return parts;
}

std::string shape_string(const std::vector<uint64_t>& shape) {
    std::string s = "(";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + (shape.size() == 1 ? ",)" : ")");
}

}  // namespace container
}  // namespace deepreduce
