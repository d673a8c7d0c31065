// Pipeline.encode in C++ (see pipeline.h): error feedback, selection, index and value codecs,
// the container.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "bitpack.h"
#include "bloom_wire.h"
#include "elias_fano.h"
#include "common/checks.h"
#include "common/error.h"
#include "fit.h"
#include "fp16.h"
#include "pipeline.h"
#include "seeding.h"
#include "select.h"

namespace deepreduce {
namespace pipeline {

namespace {

namespace ct = container;

constexpr size_t DIGEST_BYTES = 16;

// The tensor as the core's messages name it (Python's repr of a plain name).
std::string who(const std::string& name) {
    return "tensor '" + name + "'";
}

// sparsify._base.count_for: floor(ratio * numel), at least 1, at most numel.
int64_t count_for(double ratio, int64_t numel) {
    if (numel == 0) return 0;
    return std::min<int64_t>(numel, std::max<int64_t>(1, static_cast<int64_t>(std::floor(ratio * numel))));
}

// bitpack.width_for: bits for integers in [0, v] (at least 1).
int width_for(uint64_t v) {
    int w = 0;
    for (; v; v >>= 1) ++w;
    return std::max(1, w);
}

// The payload of header h (its lengths set but the params'), with the header and params written.
uint8_t* start_container(ct::Header& h, const std::string& index_params, const std::string& value_params,
                         const PayloadAllocator& payload) {
    h.lengths[ct::INDEX_PARAMS] = index_params.size();
    h.lengths[ct::VALUE_PARAMS] = value_params.size();
    h.size = ct::header_size(h);
    uint8_t* p = payload(static_cast<size_t>(h.total()));
    ct::write_header(h, p);
    std::memcpy(p + h.size, index_params.data(), index_params.size());
    std::memcpy(p + h.size + index_params.size(), value_params.data(), value_params.size());
    return p;
}

// The values the receiver reconstructs from `sent` (fp16: rounded; polyfit: the fitted curves),
// and the value section, its params and (polyfit) the order of the values.
struct Values {
    std::vector<float> received;
    std::vector<uint8_t> section;
    std::string params;
    std::vector<int64_t> order;  // polyfit: section value j belongs to sent[order[j]]
    uint8_t id = 0;
};

Values encode_values(const EncodeConfig& c, const std::string& name, const std::vector<float>& sent) {
    const int64_t m = static_cast<int64_t>(sent.size());
    Values v;
    v.received = sent;
    if (c.value == ValueCodec::RAW) {
        v.section.resize(4 * sent.size());
        if (m) std::memcpy(v.section.data(), sent.data(), 4 * sent.size());  // little-endian float32
        return v;
    }
    if (c.value == ValueCodec::FP16) {
        float top = 0.0f;
        for (float x : sent) top = std::max(top, std::fabs(x));
        if (m && top > fp16::MAX) {
            char buf[64];
            std::snprintf(buf, sizeof(buf), "%.4g", static_cast<double>(top));
            fail(ErrorKind::ENCODE, "fp16 value codec: " + who(name) + " has a value of magnitude " + buf +
                                        " beyond float16's 65504.0; use 'raw' or scale the loss");
        }
        v.id = 1;
        v.section.resize(2 * sent.size());
        for (int64_t j = 0; j < m; ++j) {
            const uint16_t half = fp16::from_float(sent[j]);
            std::memcpy(v.section.data() + 2 * j, &half, 2);
            v.received[j] = fp16::to_float(half);
        }
        return v;
    }
    v.id = 2;  // polyfit
    const fit::Params params{c.degree, c.coef_bytes};
    v.params = fit::pack_params(params);
    v.order.resize(m);
    try {
        const int64_t bound = fit::payload_bound(m, c.degree, c.segments, c.coef_bytes);
        v.section.resize(static_cast<size_t>(bound));
        const int64_t len = fit::encode(sent.data(), m, c.degree, c.segments, c.min_points, c.coef_bytes,
                                        v.order.data(), v.section.data(), bound);
        v.section.resize(static_cast<size_t>(len));
    } catch (const Error& e) {
        fail(ErrorKind::ENCODE, "polyfit encode of " + who(name) + " failed: " + e.what());
    }
    std::vector<float> curve(m);  // the receiver's values: the fitted curves
    try {
        fit::decode(v.section.data(), static_cast<int64_t>(v.section.size()), m, c.degree, c.coef_bytes, curve.data());
    } catch (const Error& e) {
        fail(ErrorKind::ENCODE, "polyfit: the fit of " + who(name) + " does not decode: " + e.what());
    }
    for (int64_t j = 0; j < m; ++j) v.received[v.order[j]] = curve[j];
    return v;
}

}  // namespace

Sparsifier sparsifier_named(const std::string& id) {
    if (id == "topk") return Sparsifier::TOPK;
    if (id == "threshold") return Sparsifier::THRESHOLD;
    fail(ErrorKind::ARGUMENT, "sparsifier '" + id + "' has no C++ stage (topk, threshold)");
}

IndexCodec index_named(const std::string& id) {
    if (id == "raw") return IndexCodec::RAW;
    if (id == "bloom") return IndexCodec::BLOOM;
    if (id == "elias_fano") return IndexCodec::ELIAS_FANO;
    fail(ErrorKind::ARGUMENT, "index codec '" + id + "' has no C++ stage (raw, bloom, elias_fano)");
}

ValueCodec value_named(const std::string& id) {
    if (id == "raw") return ValueCodec::RAW;
    if (id == "fp16") return ValueCodec::FP16;
    if (id == "polyfit") return ValueCodec::POLYFIT;
    fail(ErrorKind::ARGUMENT, "value codec '" + id + "' has no C++ stage (raw, fp16, polyfit)");
}

void EncodeConfig::check() const {
    if (digest.size() != DIGEST_BYTES) fail(ErrorKind::ARGUMENT, "the config digest must have 16 bytes");
    check_threads(threads);
    if (index == IndexCodec::BLOOM) {
        check_range("k", static_cast<uint64_t>(k), 1, bloom::MAX_K);
        check_range("policy", static_cast<uint64_t>(policy), 0, bloom::POLICY_COUNT - 1);
        if (!(keys_per_block > 0)) fail(ErrorKind::ARGUMENT, "Bloom keys per block must be positive");
    }
}

namespace {

// Memory.accumulate and the selection of one whole tensor: the compensated gradient (the
// residual, or the gradient without error feedback or when it is not finite) and, for a finite
// tensor of at least min_numel elements, the ascending positions to send.
struct Selection {
    bool finite = true;
    bool sparse = true;
    const float* comp = nullptr;
    float* res = nullptr;
    std::vector<int64_t> positions;
};

Selection select_tensor(const EncodeConfig& c, const std::string& name, const float* g, int64_t n,
                        const Residual& residual, const ResidualAllocator& new_residual) {
    Selection s;
    s.res = c.error_feedback && residual.numel > 0 ? residual.data : nullptr;
    if (s.res && residual.numel != n)
        fail(ErrorKind::COMMUNICATION, "residual memory: " + who(name) + " had " + std::to_string(residual.numel) +
                                           " elements, now " + std::to_string(n) + "; a name must keep its size");
    s.sparse = n >= c.min_numel;
    const bool topk = c.sparsifier == Sparsifier::TOPK;
    const int64_t r = s.sparse && topk ? count_for(c.ratio, n) : 0;
    const bool select_r = r > 0 && r < n;
    s.positions.resize(select_r ? r : 0);

    // error feedback: the residual absorbs the gradient (Memory.accumulate), fused with the
    // finiteness check and, where it can be, the Top-r selection
    const float* prior = s.res && residual.prior ? residual.prior : s.res;
    const select::Scan scan = select::scan(g, prior, s.res, n, select_r ? r : 0, c.threads, s.positions.data());
    s.finite = scan != select::Scan::NON_FINITE;
    s.comp = s.res && s.finite ? s.res : g;
    if (!s.res && c.error_feedback && s.finite && n > 0) {  // the first residual is the gradient
        s.res = new_residual(n);
        std::memcpy(s.res, g, sizeof(float) * n);
        s.comp = s.res;
    }
    if (!s.finite || !s.sparse) return s;

    // selection: Top-r (already done by the scan when it could be) or a threshold
    if (!topk) {
        s.positions = select::threshold(s.comp, n, c.threshold, c.threads);
    } else if (!select_r) {
        s.positions.resize(r);
        for (int64_t i = 0; i < r; ++i) s.positions[i] = i;
    } else if (scan != select::Scan::SELECTED) {
        select::topk(s.comp, n, r, c.threads, s.positions.data());
    }
    return s;
}

// The dense container of values[0..n) (float32 as they are) with `flags`.
container::Header encode_dense(const EncodeConfig& c, const std::vector<uint64_t>& shape, const float* values,
                               int64_t n, uint8_t flags, const PayloadAllocator& payload) {
    ct::Header h;
    std::memcpy(h.digest, c.digest.data(), ct::DIGEST_SIZE);
    h.shape = shape;
    h.flags = flags;
    h.n = static_cast<uint64_t>(n);
    h.lengths[ct::VALUE] = 4 * static_cast<uint64_t>(n);
    uint8_t* out = start_container(h, "", "", payload);
    if (n) std::memcpy(out + h.size, values, 4 * n);  // little-endian float32
    ct::finish(out, static_cast<size_t>(h.total()));
    return h;
}

// What Memory.settle takes out of the residual: the receivers' values at the sent positions.
struct Sent {
    std::vector<int64_t> positions;
    std::vector<float> received;
};

// Pipeline._encode_pairs: the container of the `count` ascending `positions` of comp[0..n)
// (a tensor of `shape`, seeded as `name`), the sent positions plus `offset` and the values the
// receiver reconstructs there appended to `sent`. `refuse_overflow`: non-finite values (a
// residual plus gradient beyond float32's range) raise ErrorKind::OVERFLOW with the core's text.
container::Header encode_positions(const EncodeConfig& c, const std::string& name, int64_t step, const float* comp,
                                   int64_t n, const std::vector<uint64_t>& shape, const int64_t* positions,
                                   size_t count, int64_t offset, bool refuse_overflow, const PayloadAllocator& payload,
                                   Sent& sent_out) {
    const uint64_t* ascending = reinterpret_cast<const uint64_t*>(positions);  // non-negative
    if (refuse_overflow)
        for (size_t j = 0; j < count; ++j)
            if (!std::isfinite(comp[positions[j]]))
                fail(ErrorKind::OVERFLOW, std::to_string(count) + " selected values include NaN/Inf");
    ct::Header h;
    std::memcpy(h.digest, c.digest.data(), ct::DIGEST_SIZE);
    h.shape = shape;

    // the index codec: which positions carry values, and the values
    std::string index_params;
    std::vector<uint8_t> index_section;
    std::vector<uint64_t> bloom_chosen;
    const int64_t* chosen = positions;
    std::vector<float> sent;
    if (c.index == IndexCodec::BLOOM) {
        const uint64_t draw_seed =
            bloom::draws(c.policy)
                ? seeding::derive_seed(c.digest, name, step, std::string("bloom-") + bloom::POLICIES[c.policy])
                : 0;
        bloom::Encoded e = bloom::encode(ascending, count, static_cast<uint64_t>(n), c.policy, c.k, c.keys_per_block,
                                         c.hash_seed, draw_seed, c.threads);
        index_params.swap(e.params);
        index_section.swap(e.filter);
        bloom_chosen.swap(e.chosen);
        chosen = reinterpret_cast<const int64_t*>(bloom_chosen.data());
        sent.resize(bloom_chosen.size());
        const int64_t* source = c.policy == bloom::NAIVE ? positions : chosen;  // naive: the support's values
        for (size_t j = 0; j < sent.size(); ++j) sent[j] = comp[source[j]];
        if (refuse_overflow)  // a filter's false positives
            for (float x : sent)
                if (!std::isfinite(x))
                    fail(ErrorKind::OVERFLOW,
                         std::to_string(sent.size()) + " values at the index codec's positions include NaN/Inf");
        h.index_id = 1;
        h.lengths[ct::INDEX] = index_section.size();
    } else {
        sent.resize(count);
        for (size_t j = 0; j < count; ++j) sent[j] = comp[positions[j]];
        if (c.index == IndexCodec::ELIAS_FANO) {
            index_section = elias_fano::encode(ascending, count, static_cast<uint64_t>(n));
            h.index_id = elias_fano::WIRE_ID;
            h.lengths[ct::INDEX] = index_section.size();
        } else {
            h.lengths[ct::INDEX] = count * (n <= (int64_t(1) << 32) ? 4 : 8);
        }
    }
    const int64_t m = static_cast<int64_t>(sent.size());

    // the value codec; polyfit reorders the values: raw indices follow them, an ascending set
    // (Bloom, Elias-Fano) sends the order as a permutation
    Values v = encode_values(c, name, sent);
    h.value_id = v.id;
    const bool permuted = c.value == ValueCodec::POLYFIT && c.index != IndexCodec::RAW && m;
    if (permuted) {
        h.perm_width = static_cast<uint8_t>(width_for(static_cast<uint64_t>(m - 1)));
        h.flags |= ct::FLAG_PERMUTED;
        h.lengths[ct::PERM] = bitpack::packed_size(static_cast<uint64_t>(m), h.perm_width);
    }
    h.n = static_cast<uint64_t>(m);
    h.lengths[ct::VALUE] = v.section.size();
    uint8_t* out = start_container(h, index_params, v.params, payload);
    uint8_t* section = out + h.size + index_params.size() + v.params.size();
    if (c.index != IndexCodec::RAW) {
        std::copy(index_section.begin(), index_section.end(), section);
    } else {  // raw indices, in the order of the values
        const bool narrow = h.lengths[ct::INDEX] == 4 * static_cast<uint64_t>(m);
        const bool reordered = !v.order.empty();
        for (int64_t j = 0; j < m; ++j) {
            const uint64_t x = static_cast<uint64_t>(chosen[reordered ? v.order[j] : j]);
            std::memcpy(section + (narrow ? 4 : 8) * j, &x, narrow ? 4 : 8);  // little-endian
        }
    }
    section += h.lengths[ct::INDEX];
    std::copy(v.section.begin(), v.section.end(), section);
    section += h.lengths[ct::VALUE];
    if (permuted)  // the order's entries are non-negative positions
        bitpack::pack(reinterpret_cast<const uint64_t*>(v.order.data()), static_cast<uint64_t>(m), h.perm_width,
                      section);
    ct::finish(out, static_cast<size_t>(h.total()));
    for (int64_t j = 0; j < m; ++j) sent_out.positions.push_back(chosen[j] + offset);
    sent_out.received.insert(sent_out.received.end(), v.received.begin(), v.received.end());
    return h;
}

// Memory.settle: residual[positions] -= what the receivers reconstruct.
void settle(float* res, Sent& sent, int threads) {
    if (!res || sent.positions.empty()) return;
    for (float& x : sent.received) x = -x;
    select::scatter_add(res, sent.positions.data(), sent.received.data(), static_cast<int64_t>(sent.positions.size()),
                        threads);
}

int64_t numel_of(const std::vector<uint64_t>& shape) {
    int64_t n = 1;
    for (uint64_t s : shape) n *= static_cast<int64_t>(s);
    return n;
}

}  // namespace

container::Header encode(const EncodeConfig& c, const std::string& name, int64_t step, const float* g,
                         const std::vector<uint64_t>& shape, const Residual& residual,
                         const ResidualAllocator& new_residual, const PayloadAllocator& payload) {
    const int64_t n = numel_of(shape);
    Selection s = select_tensor(c, name, g, n, residual, new_residual);
    if (!s.finite || !s.sparse) {  // dense: the gradient as it is (non-finite) or the compensated one
        const container::Header h =
            encode_dense(c, shape, s.comp, n, s.finite ? ct::FLAG_DENSE : ct::FLAG_DENSE | ct::FLAG_NONFINITE, payload);
        if (s.finite && s.res) std::fill(s.res, s.res + n, 0.0f);  // sent exactly
        return h;
    }
    Sent sent;
    const container::Header h = encode_positions(c, name, step, s.comp, n, shape, s.positions.data(),
                                                 s.positions.size(), 0, false, payload, sent);
    settle(s.res, sent, c.threads);
    return h;
}

std::vector<container::Header> encode_shards(const EncodeConfig& c, const std::string& name, int64_t step,
                                             const float* g, int64_t n, const std::vector<int64_t>& bounds,
                                             const Residual& residual, const ResidualAllocator& new_residual,
                                             const ShardAllocator& payload) {
    if (bounds.size() < 2 || bounds.front() != 0 || bounds.back() != n)
        fail(ErrorKind::ARGUMENT, "shard bounds must rise from 0 to " + std::to_string(n));
    for (size_t j = 1; j < bounds.size(); ++j)
        if (bounds[j] < bounds[j - 1])
            fail(ErrorKind::ARGUMENT, "shard bounds must rise from 0 to " + std::to_string(n));
    Selection s = select_tensor(c, name, g, n, residual, new_residual);
    const size_t shards = bounds.size() - 1;
    std::vector<container::Header> out;
    out.reserve(shards);
    if (!s.finite || !s.sparse) {
        for (size_t j = 0; j < shards; ++j) {
            const int64_t lo = bounds[j], len = bounds[j + 1] - lo;
            out.push_back(encode_dense(c, {static_cast<uint64_t>(len)}, s.comp + lo, len,
                                       s.finite ? ct::FLAG_DENSE : ct::FLAG_DENSE | ct::FLAG_NONFINITE,
                                       [&](size_t bytes) { return payload(j, bytes); }));
        }
        if (s.finite && s.res) std::fill(s.res, s.res + n, 0.0f);
        return out;
    }
    Sent sent;
    std::vector<int64_t> relative;
    const int64_t* begin = s.positions.data();
    const int64_t* end = begin + s.positions.size();
    for (size_t j = 0; j < shards; ++j) {
        const int64_t lo = bounds[j], hi = bounds[j + 1];
        const int64_t* first = std::lower_bound(begin, end, lo);
        const int64_t* last = std::lower_bound(first, end, hi);
        relative.assign(first, last);
        for (int64_t& p : relative) p -= lo;
        out.push_back(encode_positions(
            c, name + "#" + std::to_string(j), step, s.comp + lo, hi - lo, {static_cast<uint64_t>(hi - lo)},
            relative.data(), relative.size(), lo, c.error_feedback, [&](size_t bytes) { return payload(j, bytes); },
            sent));
    }
    settle(s.res, sent, c.threads);
    return out;
}

}  // namespace pipeline
}  // namespace deepreduce
