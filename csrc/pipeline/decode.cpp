// Pipeline.decode / decode_sum in C++ (see pipeline.h): split, header checks, the index and
// value codecs, the permutation, the finiteness check, the scatter-add.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>

#include "bitpack.h"
#include "bloom_wire.h"
#include "elias_fano.h"
#include "common/checks.h"
#include "common/error.h"
#include "fit.h"
#include "fp16.h"
#include "pipeline.h"
#include "select.h"

namespace deepreduce {
namespace pipeline {

namespace {

namespace ct = container;

[[noreturn]] void container_error(const std::string& message) {
    fail(ErrorKind::CONTAINER, message);
}

// The positions of a sparse container (the core's index codecs raw, bloom and elias_fano).
std::vector<int64_t> decode_indices(const ct::Header& h, const uint8_t* params, const uint8_t* section, uint64_t numel,
                                    int threads) {
    const uint64_t n = h.n;
    if (h.index_id == 0) {
        const uint64_t width = numel <= (uint64_t(1) << 32) ? 4 : 8;
        if (h.lengths[ct::INDEX_PARAMS] || h.lengths[ct::INDEX] != n * width)
            container_error("raw index section has " + std::to_string(h.lengths[ct::INDEX]) + " bytes, expected " +
                            std::to_string(n * width));
        std::vector<int64_t> out(n);
        for (uint64_t j = 0; j < n; ++j) {
            uint64_t v = 0;
            std::memcpy(&v, section + width * j, width);
            out[j] = static_cast<int64_t>(v);
        }
        return out;
    }
    if (h.index_id == elias_fano::WIRE_ID)
        return elias_fano::decode(section, h.lengths[ct::INDEX], h.lengths[ct::INDEX_PARAMS], n, numel);
    if (h.index_id != 1)
        container_error("container index codec id " + std::to_string(h.index_id) +
                        " has no TensorFlow op (the ops decode raw, bloom and elias_fano indices); build the "
                        "pipeline with backend='numpy_function' to decode it");
    const std::vector<uint64_t> chosen =
        bloom::decode(params, h.lengths[ct::INDEX_PARAMS], section, h.lengths[ct::INDEX], n, numel, threads);
    return std::vector<int64_t>(chosen.begin(), chosen.end());
}

// The values of a sparse container (the core's value codecs raw, fp16 and polyfit).
std::vector<float> decode_values(const ct::Header& h, const uint8_t* params, const uint8_t* section) {
    const uint64_t n = h.n, len = h.lengths[ct::VALUE];
    std::vector<float> out;
    if (h.value_id == 2) {  // PolyFit.decode
        const fit::Params p = fit::unpack_params(params, h.lengths[ct::VALUE_PARAMS]);
        fit::check_payload(section, static_cast<int64_t>(len), static_cast<int64_t>(n), p.degree, p.coef_bytes);
        out.resize(n);
        fit::decode(section, static_cast<int64_t>(len), static_cast<int64_t>(n), p.degree, p.coef_bytes, out.data());
        return out;
    }
    if (h.value_id > 2)
        container_error("container value codec id " + std::to_string(h.value_id) +
                        " has no TensorFlow op (the ops decode raw, fp16 and polyfit values); build the "
                        "pipeline with backend='numpy_function' to decode it");
    const uint64_t width = h.value_id == 0 ? 4 : 2;
    if (len != n * width)
        container_error(std::string(h.value_id == 0 ? "raw" : "fp16") + " value section has " + std::to_string(len) +
                        " bytes, expected " + std::to_string(n * width));
    out.resize(n);
    if (width == 4) {
        if (n) std::memcpy(out.data(), section, 4 * n);
    } else {
        for (uint64_t j = 0; j < n; ++j) {
            uint16_t v;
            std::memcpy(&v, section + 2 * j, 2);
            out[j] = fp16::to_float(v);
        }
    }
    return out;
}

// Value j belongs to indices[perm[j]]: the values in index order (Pipeline._decode_into).
void unpermute(const ct::Header& h, const uint8_t* section, std::vector<float>& values) {
    bitpack::check(h.lengths[ct::PERM], h.perm_width, h.n);
    std::vector<uint64_t> perm(h.n);
    bitpack::unpack(section, h.lengths[ct::PERM], h.perm_width, h.n, perm.data());
    std::vector<char> seen(h.n, 0);
    for (uint64_t p : perm) {
        if (p >= h.n || seen[p]) container_error("container permutation section is not a permutation");
        seen[p] = 1;
    }
    std::vector<float> ordered(h.n);
    for (uint64_t j = 0; j < h.n; ++j) ordered[perm[j]] = values[j];
    values.swap(ordered);
}

// pipeline._check_finite: a container without the NONFINITE flag must decode to finite values.
void check_finite(const ct::Header& h, const float* values, uint64_t n, const char* what) {
    if (h.flags & ct::FLAG_NONFINITE) return;
    for (uint64_t i = 0; i < n; ++i)
        if (!std::isfinite(values[i]))
            container_error(std::string("container ") + what +
                            " hold NaN/Inf but its header does not carry the non-finite flag");
}

// A sparse container's positions and values, decoded and checked without writing anywhere: the
// first container of a decode_sum is decoded before its tensor is allocated, so a container
// refused here costs no tensor of the size it claims.
struct Sparse {
    std::vector<int64_t> indices;
    std::vector<float> values;
};

Sparse decode_sparse(const ct::Header& h, const uint8_t* buf, uint64_t numel, int threads) {
    const uint8_t* params = buf + h.size;
    const uint8_t* sections = params + h.lengths[ct::INDEX_PARAMS] + h.lengths[ct::VALUE_PARAMS];
    Sparse s;
    s.indices = decode_indices(h, params, sections, numel, threads);
    s.values = decode_values(h, params + h.lengths[ct::INDEX_PARAMS], sections + h.lengths[ct::INDEX]);
    check_finite(h, s.values.data(), s.values.size(), "values");
    if (h.permuted()) unpermute(h, sections + h.lengths[ct::INDEX] + h.lengths[ct::VALUE], s.values);
    const int64_t n = static_cast<int64_t>(h.n);
    if (n && h.index_id != 1 && h.index_id != elias_fano::WIRE_ID) {  // kernels.check_indices(ascending=False)
        std::vector<int64_t> sorted(s.indices);
        std::sort(sorted.begin(), sorted.end());
        for (int64_t j = 1; j < n; ++j)
            if (sorted[j] == sorted[j - 1]) container_error("container repeats an index");
        if (sorted[0] < 0 || static_cast<uint64_t>(sorted[n - 1]) >= numel)
            container_error("container index out of range for a tensor of " + std::to_string(numel) + " elements");
    }
    return s;
}

// Add a decoded sparse container into target.
void scatter(const ct::Header& h, const Sparse& s, uint64_t numel, int threads, float* target) {
    const int64_t n = static_cast<int64_t>(h.n);
    if (h.index_id == 1 || h.index_id == elias_fano::WIRE_ID)  // ascending sets, checked by the kernel
        select::scatter_add_checked(target, static_cast<int64_t>(numel), s.indices.data(), s.values.data(), n, threads);
    else
        select::scatter_add(target, s.indices.data(), s.values.data(), n, threads);
}

// A dense container's values, checked.
std::vector<float> dense_values(const ct::Header& h, const uint8_t* buf, uint64_t numel) {
    const uint8_t* sections = buf + h.size + h.lengths[ct::INDEX_PARAMS] + h.lengths[ct::VALUE_PARAMS];
    std::vector<float> dense(numel);
    if (numel) std::memcpy(dense.data(), sections, 4 * numel);
    check_finite(h, dense.data(), numel, "dense section");
    return dense;
}

// Pipeline._decode_into: add the container's tensor into target.
void add_container(const ct::Header& h, const uint8_t* buf, uint64_t numel, int threads, float* target) {
    if (h.dense()) {
        const std::vector<float> dense = dense_values(h, buf, numel);
        for (uint64_t i = 0; i < numel; ++i) target[i] += dense[i];
        return;
    }
    scatter(h, decode_sparse(h, buf, numel, threads), numel, threads, target);
}

// Pipeline.decode into target, each value divided by `divisor`: target then holds zeros outside
// a sparse container's entries (an entry is 0 + v, as adding into zeros gives it).
void write_container(const ct::Header& h, const uint8_t* buf, uint64_t numel, int threads, float* target,
                     float divisor) {
    if (h.dense()) {
        const std::vector<float> dense = dense_values(h, buf, numel);
        for (uint64_t i = 0; i < numel; ++i) target[i] = dense[i] / divisor;
        return;
    }
    const Sparse s = decode_sparse(h, buf, numel, threads);
    std::fill(target, target + numel, 0.0f);
    scatter(h, s, numel, threads, target);
    if (divisor != 1.0f)
        for (const int64_t i : s.indices) target[i] /= divisor;
}

}  // namespace

size_t decode_sum(const DecodeConfig& c, const uint8_t* buf, size_t len, const TensorAllocator& tensor) {
    std::vector<Part> parts;
    if (c.single) {
        parts.push_back({buf, len});
    } else {
        for (const auto& p : ct::split(buf, len)) parts.push_back({buf + p.first, p.second});
        if (c.count >= 0 && static_cast<int64_t>(parts.size()) != c.count)
            fail(ErrorKind::COMMUNICATION, "allgather returned " + std::to_string(parts.size()) + " containers for " +
                                               std::to_string(c.count) + " ranks");
    }
    return decode_sum(c, parts, tensor);
}

void decode_shards(const std::vector<Part>& parts, const std::vector<int64_t>& bounds, float* out, int threads,
                   float divisor) {
    check_threads(threads);
    if (!(divisor > 0.0f) || !std::isfinite(divisor))
        fail(ErrorKind::ARGUMENT, "divisor must be a positive finite number, got " + std::to_string(divisor));
    if (bounds.size() != parts.size() + 1)
        fail(ErrorKind::ARGUMENT, std::to_string(parts.size()) + " containers for " +
                                      std::to_string(bounds.empty() ? 0 : bounds.size() - 1) + " shards");
    for (size_t j = 0; j < parts.size(); ++j) {
        if (bounds[j + 1] < bounds[j]) fail(ErrorKind::ARGUMENT, "shard bounds must not fall");
        const std::vector<uint64_t> shape{static_cast<uint64_t>(bounds[j + 1] - bounds[j])};
        ct::Header h;
        const uint64_t numel = ct::unpack(parts[j].data, parts[j].size, h, &shape);
        try {
            write_container(h, parts[j].data, numel, threads, out + bounds[j], divisor);
        } catch (const std::bad_alloc&) {
            fail(ErrorKind::CONTAINER,
                 "shard " + std::to_string(j) + ": container decode ran out of memory (std::bad_alloc)");
        }
    }
}

size_t decode_sum(const DecodeConfig& c, const std::vector<Part>& parts, const TensorAllocator& tensor) {
    check_threads(c.threads);
    if (parts.empty()) fail(ErrorKind::COMMUNICATION, "no containers to decode");
    bool have_shape = c.check_shape;
    std::vector<uint64_t> expected = c.shape;
    float* target = nullptr;
    for (size_t rank = 0; rank < parts.size(); ++rank) {
        try {
            ct::Header h;
            const uint64_t numel =
                ct::unpack(parts[rank].data, parts[rank].size, h, have_shape ? &expected : nullptr, c.max_numel);
            if (!target) {  // the first container gives the shape every other one must have
                expected = h.shape;
                have_shape = true;
                if (!h.dense()) {  // decoded before its tensor exists: a refused one costs none
                    const Sparse s = decode_sparse(h, parts[rank].data, numel, c.threads);
                    target = tensor(h.shape, numel);
                    std::fill(target, target + numel, 0.0f);
                    scatter(h, s, numel, c.threads, target);
                    continue;
                }
                target = tensor(h.shape, numel);
                std::fill(target, target + numel, 0.0f);
            }
            add_container(h, parts[rank].data, numel, c.threads, target);
        } catch (const Error& e) {
            if (c.single) throw;
            throw Error(e.kind(), "rank " + std::to_string(rank) + ": " + e.what());
        } catch (const std::bad_alloc&) {  // the codecs bound what they allocate; this is what is left
            const std::string what = "container decode ran out of memory (std::bad_alloc)";
            fail(ErrorKind::CONTAINER, c.single ? what : "rank " + std::to_string(rank) + ": " + what);
        }
    }
    return parts.size();
}

}  // namespace pipeline
}  // namespace deepreduce
