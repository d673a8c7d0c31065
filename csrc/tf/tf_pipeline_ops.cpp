// The TensorFlow pipeline ops: one op encodes a gradient into a container, one op decodes (and
// sums) containers, for the configs whose every stage exists in C++: error feedback with Top-r
// (fused) or threshold selection (csrc/select), raw or Bloom indices with every policy
// (csrc/bloom), raw, fp16 or polyfit values (csrc/fit), and the container itself
// (csrc/container). They call the functions the pybind11
// extensions wrap, so the bytes are deepreduce.build(config).encode's (tests check every config);
// deepreduce/tensorflow/ops.py builds their attributes from the core pipeline.
//
// TF runs op kernels with denormals flushed to zero; these compute with the default floating-point
// environment, as the core does anywhere else (tensorflow/fpenv.py does the same for py_funcs).
//
// Errors fail the op with InvalidArgument whose message starts with the deepreduce error class
// ("ContainerError: ...") followed by the core's own text; ops.py raises that class eagerly.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bitpack.h"
#include "bloom.h"
#include "container.h"
#include "fit.h"
#include "select.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/denormal.h"
#include "wire.h"

namespace bl = deepreduce::bloom;
namespace bp = deepreduce::bitpack;
namespace ct = deepreduce::container;
namespace wr = deepreduce::wire;
using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::shape_inference::InferenceContext;

// Layout of the int64 statistics vector both ops return (added to the pipeline's counters).
enum Stat { ENCODED, DECODED, DENSE_BYTES, WIRE_BYTES, INDEX_BYTES, VALUE_BYTES, PERM_BYTES, HEADER_BYTES,
            ENCODE_NS, DECODE_NS, STATS };

REGISTER_OP("DeepReduceEncode")
    .Input("grad: float")
    .Input("step: int64")
    .Input("residual: float")
    .Output("payload: uint8")
    .Output("new_residual: float")
    .Output("stats: int64")
    .Attr("tensor_name: string")
    .Attr("digest: string")
    .Attr("min_numel: int >= 0")
    .Attr("sparsifier: {'topk', 'threshold'} = 'topk'")
    .Attr("ratio_bits: int = 0")
    .Attr("threshold: float = 0")
    .Attr("error_feedback: bool")
    .Attr("index: {'raw', 'bloom'}")
    .Attr("policy: {'naive', 'p0', 'p1', 'p2', 'leftmost', 'middle', 'rightmost'} = 'p0'")
    .Attr("keys_per_block_bits: int = 0")
    .Attr("k: int = 1")
    .Attr("hash_seed: int = 0")
    .Attr("value: {'raw', 'fp16', 'polyfit'}")
    .Attr("degree: int = 5")
    .Attr("segments: int = 0")
    .Attr("min_points: int = 6")
    .Attr("coef_bytes: int = 4")
    .Attr("threads: int >= 1 = 1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
        c->set_output(0, c->Vector(c->UnknownDim()));
        c->set_output(1, c->Vector(c->UnknownDim()));
        c->set_output(2, c->Vector(STATS));
        return tensorflow::OkStatus();
    })
    .Doc("One container for grad (deepreduce Pipeline.encode). `residual` is the error-feedback residual "
         "(empty: none yet); `new_residual` replaces it.");

REGISTER_OP("DeepReduceDecode")
    .Input("payload: uint8")
    .Output("tensor: float")
    .Output("stats: int64")
    .Attr("count: int = -1")
    .Attr("single: bool = false")
    .Attr("shape: list(int) = []")
    .Attr("check_shape: bool = false")
    .Attr("max_numel: int >= 1")
    .Attr("threads: int >= 1 = 1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
        bool check;
        std::vector<int64_t> shape;
        TF_RETURN_IF_ERROR(c->GetAttr("check_shape", &check));
        TF_RETURN_IF_ERROR(c->GetAttr("shape", &shape));
        if (check) {
            std::vector<tensorflow::shape_inference::DimensionHandle> dims;
            for (int64_t s : shape) dims.push_back(c->MakeDim(s));
            c->set_output(0, c->MakeShape(dims));
        } else {
            c->set_output(0, c->UnknownShape());
        }
        c->set_output(1, c->Vector(STATS));
        return tensorflow::OkStatus();
    })
    .Doc("The sum of the tensors of the concatenated containers in payload (Pipeline.decode_sum; "
         "single: exactly one container, Pipeline.decode).");

namespace {

std::string name_repr(const std::string& name) { return "'" + name + "'"; }

double bits_to_double(int64_t bits) {
    double d;
    std::memcpy(&d, &bits, sizeof(d));
    return d;
}

// sparsify._base.count_for
int64_t count_for(double ratio, int64_t numel) {
    if (numel == 0) return 0;
    return std::min<int64_t>(numel, std::max<int64_t>(1, static_cast<int64_t>(std::floor(ratio * numel))));
}

float half_to_float(uint16_t h) {
    return static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(h));
}

uint16_t float_to_half(float f) { return Eigen::numext::bit_cast<uint16_t>(Eigen::half(f)); }

constexpr float FP16_MAX = 65504.0f;

// bitpack.width_for: bits for integers in [0, v] (at least 1).
int width_for(uint64_t v) {
    int w = 0;
    for (; v; v >>= 1) ++w;
    return std::max(1, w);
}

void fail(OpKernelContext* ctx, const char* kind, const std::string& message) {
    ctx->CtxFailure(tensorflow::errors::InvalidArgument(std::string(kind) + ": " + message));
}

class EncodeOp : public OpKernel {
 public:
    explicit EncodeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
        int64_t ratio_bits, lam_bits, hash_seed;
        std::string index, value, policy;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("tensor_name", &name_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("digest", &digest_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("min_numel", &min_numel_));
        std::string sparsifier;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("sparsifier", &sparsifier));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("ratio_bits", &ratio_bits));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("threshold", &threshold_));
        topk_ = sparsifier == "topk";
        OP_REQUIRES_OK(ctx, ctx->GetAttr("error_feedback", &error_feedback_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("index", &index));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("policy", &policy));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("keys_per_block_bits", &lam_bits));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("k", &k_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("hash_seed", &hash_seed));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("value", &value));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("degree", &degree_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("segments", &segments_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("min_points", &min_points_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("coef_bytes", &coef_bytes_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("threads", &threads_));
        OP_REQUIRES(ctx, digest_.size() == 16, tensorflow::errors::InvalidArgument("digest must have 16 bytes"));
        ratio_ = bits_to_double(ratio_bits);
        keys_per_block_ = bits_to_double(lam_bits);
        bloom_ = index == "bloom";
        fp16_ = value == "fp16";
        polyfit_ = value == "polyfit";
        policy_ = wr::bloom_policy_code(policy);
        hash_seed_ = static_cast<uint64_t>(hash_seed);
        OP_REQUIRES(ctx, !bloom_ || (k_ >= 1 && k_ <= bl::MAX_K && keys_per_block_ > 0),
                    tensorflow::errors::InvalidArgument("Bloom needs k in [1, 64] and keys per block > 0"));
    }

    void Compute(OpKernelContext* ctx) override {
        tensorflow::port::ScopedDontFlushDenormal keep_denormals;
        const auto start = std::chrono::steady_clock::now();
        const Tensor& grad = ctx->input(0);
        const int64_t step = ctx->input(1).scalar<int64_t>()();
        const Tensor& res_in = ctx->input(2);
        const int64_t n = grad.NumElements();
        const float* g = grad.flat<float>().data();
        const bool has_residual = error_feedback_ && res_in.NumElements() > 0;
        if (has_residual && res_in.NumElements() != n)
            return fail(ctx, "CommunicationError",
                        "residual memory: tensor " + name_repr(name_) + " had " + std::to_string(res_in.NumElements()) +
                            " elements, now " + std::to_string(n) + "; a name must keep its size");
        const bool sparse = n >= min_numel_;
        const int64_t r = sparse && topk_ ? count_for(ratio_, n) : 0;
        const bool select = r > 0 && r < n;
        std::vector<int64_t> positions(select ? r : 0);

        // error feedback: the residual absorbs the gradient (Memory.accumulate)
        Tensor* res_out = nullptr;
        const float* comp = g;
        bool finite;
        dr_select::Scan scan;
        if (has_residual) {
            OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &res_out));
            float* res = res_out->flat<float>().data();
            std::memcpy(res, res_in.flat<float>().data(), sizeof(float) * n);
            scan = dr_select::scan(g, res, n, select ? r : 0, threads_, positions.data());
            finite = scan != dr_select::Scan::kNonFinite;
            if (finite) comp = res;
        } else {
            scan = dr_select::scan(g, nullptr, n, select ? r : 0, threads_, positions.data());
            finite = scan != dr_select::Scan::kNonFinite;
            const int64_t keep = error_feedback_ && finite ? n : 0;   // the first residual is the gradient
            OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({keep}), &res_out));
            if (keep) {
                std::memcpy(res_out->flat<float>().data(), g, sizeof(float) * n);
                comp = res_out->flat<float>().data();
            }
        }
        float* residual = error_feedback_ && res_out->NumElements() ? res_out->flat<float>().data() : nullptr;

        ct::Header h;
        std::memcpy(h.digest, digest_.data(), ct::DIGEST_SIZE);
        for (int d = 0; d < grad.dims(); ++d) h.shape.push_back(static_cast<uint64_t>(grad.dim_size(d)));
        std::string params;
        std::vector<int64_t> chosen;
        std::vector<uint64_t> found;
        const float* dense = nullptr;
        if (!finite) {
            h.flags = ct::FLAG_DENSE | ct::FLAG_NONFINITE;
            dense = g;
        } else if (!sparse) {
            h.flags = ct::FLAG_DENSE;
            dense = comp;
        }
        if (dense) {
            h.n = static_cast<uint64_t>(n);
            h.lengths[ct::VALUE] = 4 * static_cast<uint64_t>(n);
            uint8_t* out = allocate(ctx, h, params, "");
            if (!out) return;
            std::memcpy(out + h.size, dense, 4 * n);   // little-endian float32
            if (finite && residual) std::fill(residual, residual + n, 0.0f);   // sent exactly
            return done(ctx, h, n, start);
        }

        // selection: Top-r (fused into the compensation pass when it could be) or a threshold
        if (!topk_) {
            positions = dr_select::threshold(comp, n, threshold_, threads_);
        } else if (!select) {
            positions.resize(r);
            for (int64_t i = 0; i < r; ++i) positions[i] = i;
        } else if (scan != dr_select::Scan::kSelected) {
            dr_select::topk(comp, n, r, threads_, positions.data());
        }
        const int64_t count = static_cast<int64_t>(positions.size());
        std::vector<float> sent;
        std::vector<uint8_t> bits;   // the Bloom filter
        uint64_t blocks = 0;
        if (bloom_) {
            if (count > 0) blocks = std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(count / keys_per_block_)));
            if (blocks > bl::blocked::MAX_BLOCKS)
                return fail(ctx, "DeepReduceError", "Bloom filter for " + std::to_string(count) + " indices needs " +
                                                        std::to_string(blocks) + " blocks; at most " +
                                                        std::to_string(bl::blocked::MAX_BLOCKS));
            wr::BloomParams p;
            p.policy = policy_;
            p.k = static_cast<int>(k_);
            p.size = blocks;
            p.seed = hash_seed_;
            p.draw_seed = wr::bloom_draws(policy_) ? wr::derive_seed(digest_, name_, step, std::string("bloom-") +
                                                                                           wr::BLOOM_POLICIES[policy_])
                                                   : 0;
            wr::pack_bloom_params(p, params);
            h.index_id = 1;
            h.lengths[ct::INDEX] = blocks * bl::blocked::BLOCK_BYTES;
            bits.assign(h.lengths[ct::INDEX], 0);
            const uint64_t* idx = reinterpret_cast<const uint64_t*>(positions.data());
            const bool prefix = policy_ == 0 || policy_ == 4;   // naive, leftmost
            if (count > 0) {
                bl::blocked::build(idx, static_cast<size_t>(count), blocks, p.k, p.seed, bits.data(), threads_);
                bl::blocked::query(bits.data(), blocks, p.k, p.seed, static_cast<uint64_t>(n),
                                   prefix ? static_cast<uint64_t>(count) : static_cast<uint64_t>(n), threads_, found);
            }
            select_policy(p, found, static_cast<size_t>(count), chosen);
            sent.resize(chosen.size());
            for (size_t j = 0; j < chosen.size(); ++j) sent[j] = policy_ == 0 ? comp[positions[j]] : comp[chosen[j]];
        } else {
            chosen = positions;
            sent.resize(chosen.size());
            for (size_t j = 0; j < chosen.size(); ++j) sent[j] = comp[chosen[j]];
            h.lengths[ct::INDEX] = chosen.size() * (n <= (int64_t(1) << 32) ? 4 : 8);
        }
        const int64_t m = static_cast<int64_t>(chosen.size());
        std::vector<float> received(sent);
        std::vector<uint16_t> halves;
        if (fp16_) {
            float top = 0.0f;
            for (float v : sent) top = std::max(top, std::fabs(v));
            if (m && top > FP16_MAX) {
                char buf[64];
                std::snprintf(buf, sizeof(buf), "%.4g", static_cast<double>(top));
                return fail(ctx, "DeepReduceError", "fp16 value codec: tensor " + name_repr(name_) +
                                                        " has a value of magnitude " + buf +
                                                        " beyond float16's 65504.0; use 'raw' or scale the loss");
            }
            halves.resize(m);
            for (int64_t j = 0; j < m; ++j) {
                halves[j] = float_to_half(sent[j]);
                received[j] = half_to_float(halves[j]);
            }
            h.value_id = 1;
        }
        std::vector<uint8_t> fit;       // the polyfit payload
        std::vector<int64_t> order;     // decoded value j belongs to sent[order[j]]
        std::string value_params;
        if (polyfit_) {
            const std::string who = "tensor " + name_repr(name_);
            const int64_t bound = dr_polyfit_payload_bound(m, degree_, segments_, coef_bytes_);
            if (bound < 0) return fail(ctx, "DeepReduceError", "polyfit encode of " + who + " failed: " +
                                                                   dr_fit_error_message(static_cast<int>(bound)));
            fit.resize(static_cast<size_t>(bound));
            order.resize(m);
            const int64_t len = dr_polyfit_encode(sent.data(), m, degree_, segments_, min_points_, coef_bytes_,
                                                  order.data(), fit.data(), bound);
            if (len < 0) return fail(ctx, "DeepReduceError", "polyfit encode of " + who + " failed: " +
                                                                 dr_fit_error_message(static_cast<int>(len)));
            fit.resize(static_cast<size_t>(len));
            std::vector<float> curve(m);   // the receiver's values: the fitted curves
            const int rc = dr_polyfit_decode(fit.data(), len, m, degree_, coef_bytes_, curve.data());
            if (rc < 0) return fail(ctx, "DeepReduceError", "polyfit: the fit of " + who +
                                                                " does not decode: polyfit value section is invalid: " +
                                                                dr_fit_error_message(rc));
            for (int64_t j = 0; j < m; ++j) received[order[j]] = curve[j];
            value_params = {static_cast<char>(degree_), static_cast<char>(coef_bytes_)};
            h.value_id = 2;
            if (bloom_ && m) {   // the Bloom set is ascending: the order travels as a permutation
                h.perm_width = static_cast<uint8_t>(width_for(static_cast<uint64_t>(m - 1)));
                h.flags |= ct::FLAG_PERMUTED;
                h.lengths[ct::PERM] = bp::packed_size(static_cast<uint64_t>(m), h.perm_width);
            }
        }
        h.n = static_cast<uint64_t>(m);
        h.lengths[ct::VALUE] = polyfit_ ? fit.size() : static_cast<uint64_t>(m) * (fp16_ ? 2 : 4);
        uint8_t* out = allocate(ctx, h, params, value_params);
        if (!out) return;
        uint8_t* section = out + h.size + params.size() + value_params.size();
        if (bloom_) {
            std::copy(bits.begin(), bits.end(), section);
        } else {   // raw indices, in the order of the values (polyfit sorts them)
            const bool narrow = h.lengths[ct::INDEX] == 4 * static_cast<uint64_t>(m);
            for (int64_t j = 0; j < m; ++j) {
                const uint64_t v = static_cast<uint64_t>(chosen[polyfit_ ? order[j] : j]);
                std::memcpy(section + (narrow ? 4 : 8) * j, &v, narrow ? 4 : 8);   // little-endian
            }
        }
        section += h.lengths[ct::INDEX];
        if (polyfit_)
            std::copy(fit.begin(), fit.end(), section);
        else if (fp16_)
            std::memcpy(section, halves.data(), 2 * m);
        else
            std::memcpy(section, sent.data(), 4 * m);
        section += h.lengths[ct::VALUE];
        if (h.lengths[ct::PERM])   // the order's entries are non-negative positions
            bp::pack(reinterpret_cast<const uint64_t*>(order.data()), static_cast<uint64_t>(m), h.perm_width, section);
        // Memory.settle: residual[positions] -= what the receiver reconstructs
        if (residual && m) {
            for (float& v : received) v = -v;
            dr_select::scatter_add(residual, chosen.data(), received.data(), m, threads_);
        }
        done(ctx, h, n, start);
    }

 private:
    // The policy's choice among the positives (BloomIndex._select), ascending.
    void select_policy(const wr::BloomParams& p, const std::vector<uint64_t>& P, size_t r,
                       std::vector<int64_t>& chosen) {
        const uint64_t* first = P.data();
        size_t offset = 0, count = r;
        std::vector<uint64_t> pick;
        if (p.policy == 2 || p.policy == 3) {
            pick.resize(r);
            if (r) {
                if (p.policy == 2)
                    bl::select_random(first, P.size(), r, p.draw_seed, pick.data());
                else
                    bl::select_conflict(bl::Family::blocked, first, P.size(), r, p.size, p.k, p.seed, p.draw_seed,
                                        pick.data());
            }
            first = pick.data();
        } else if (p.policy == 1) {
            count = P.size();
        } else if (p.policy == 6) {
            offset = P.size() - r;
        } else if (p.policy == 5) {
            offset = (P.size() - r) / 2;
        }
        chosen.assign(first + offset, first + offset + count);
    }

    // The payload output for header h (its size set), with the header and params written.
    uint8_t* allocate(OpKernelContext* ctx, ct::Header& h, const std::string& params, const std::string& vparams) {
        h.lengths[ct::INDEX_PARAMS] = params.size();
        h.lengths[ct::VALUE_PARAMS] = vparams.size();
        h.size = ct::header_size(h);
        Tensor* out = nullptr;
        const int64_t total = static_cast<int64_t>(h.total());
        auto status = ctx->allocate_output(0, TensorShape({total}), &out);
        if (!status.ok()) {
            ctx->CtxFailure(status);
            return nullptr;
        }
        uint8_t* p = out->flat<uint8_t>().data();
        ct::write_header(h, p);
        std::memcpy(p + h.size, params.data(), params.size());
        std::memcpy(p + h.size + params.size(), vparams.data(), vparams.size());
        return p;
    }

    void done(OpKernelContext* ctx, const ct::Header& h, int64_t n,
              std::chrono::steady_clock::time_point start) {
        Tensor* payload = ctx->mutable_output(0);
        const int64_t total = payload->NumElements();
        ct::finish(payload->flat<uint8_t>().data(), static_cast<size_t>(total));
        Tensor* stats = nullptr;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({STATS}), &stats));
        auto s = stats->flat<int64_t>();
        for (int i = 0; i < STATS; ++i) s(i) = 0;
        const int64_t sections = static_cast<int64_t>(h.lengths[ct::INDEX] + h.lengths[ct::VALUE] + h.lengths[ct::PERM]);
        s(ENCODED) = 1;
        s(DENSE_BYTES) = 4 * n;
        s(WIRE_BYTES) = total;
        s(INDEX_BYTES) = static_cast<int64_t>(h.lengths[ct::INDEX]);
        s(VALUE_BYTES) = static_cast<int64_t>(h.lengths[ct::VALUE]);
        s(PERM_BYTES) = static_cast<int64_t>(h.lengths[ct::PERM]);
        s(HEADER_BYTES) = total - sections;
        s(ENCODE_NS) = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
                           .count();
    }

    std::string name_, digest_;
    int64_t min_numel_ = 0, k_ = 1;
    bool error_feedback_ = false, topk_ = true, bloom_ = false, fp16_ = false,
         polyfit_ = false;
    float threshold_ = 0;
    int degree_ = 5, segments_ = 0, min_points_ = 6, coef_bytes_ = 4;
    double ratio_ = 0, keys_per_block_ = 0;
    int policy_ = 1;
    uint64_t hash_seed_ = 0;
    int threads_ = 1;
};

// ------------------------------------------------------------------ decode

// Why a container could not be decoded: the deepreduce error class and the core's message.
struct Failure {
    const char* kind = nullptr;
    std::string message;
    bool failed() const { return kind != nullptr; }
};

Failure container_error(const std::string& message) { return {"ContainerError", message}; }

// The indices of a sparse container (the core's index codecs raw and bloom).
Failure decode_indices(const ct::Header& h, const uint8_t* params, const uint8_t* section, uint64_t numel,
                       int threads, std::vector<int64_t>& out) {
    const uint64_t n = h.n;
    if (h.index_id == 0) {
        const uint64_t width = numel <= (uint64_t(1) << 32) ? 4 : 8;
        if (h.lengths[ct::INDEX_PARAMS] || h.lengths[ct::INDEX] != n * width)
            return container_error("raw index section has " + std::to_string(h.lengths[ct::INDEX]) +
                                   " bytes, expected " + std::to_string(n * width));
        out.resize(n);
        for (uint64_t j = 0; j < n; ++j) {
            uint64_t v = 0;
            std::memcpy(&v, section + width * j, width);
            out[j] = static_cast<int64_t>(v);
        }
        return {};
    }
    if (h.index_id != 1)
        return container_error("container index codec id " + std::to_string(h.index_id) +
                               " has no TensorFlow op (the ops decode raw and bloom indices); build the "
                               "pipeline with backend='numpy_function' to decode it");
    wr::BloomParams p;
    std::string err = wr::unpack_bloom_params(params, h.lengths[ct::INDEX_PARAMS], p);
    if (!err.empty()) return container_error(err);
    const uint64_t len = h.lengths[ct::INDEX];
    if (len != p.filter_bytes())
        return container_error("Bloom section has " + std::to_string(len) + " bytes, expected " +
                               std::to_string(p.filter_bytes()) + " for " +
                               (p.blocked ? std::to_string(p.size) + " blocks" : "m = " + std::to_string(p.size)));
    if (!p.blocked && p.size % 8 && (section[len - 1] >> (p.size % 8)))
        return container_error("Bloom section has bits set beyond m");
    if (p.size == 0) {
        if (n) return container_error("empty Bloom filter cannot carry " + std::to_string(n) + " indices");
        out.clear();
        return {};
    }
    const bool prefix = p.policy == 0 || p.policy == 4 || p.policy == 1;   // naive, leftmost, p0
    const bl::Family family = p.blocked ? bl::Family::blocked : bl::Family::splitmix;
    uint64_t limit = n;
    std::vector<uint64_t> P;
    try {
        const uint64_t bound = bl::positive_limit(family, section, p.size, p.k, n, numel, p.policy == 3);
        if (!prefix) limit = bound;
        if (p.blocked)
            bl::blocked::query(section, p.size, p.k, p.seed, numel, limit, threads, P);
        else
            bl::splitmix::query(section, p.size, p.k, p.seed, numel, limit, threads, P);
    } catch (const std::invalid_argument& e) {
        return container_error(std::string("Bloom decode: ") + e.what());
    }
    const uint64_t npos = P.size();
    if (p.policy == 1 && npos != n)
        return container_error("Bloom P0 filter has " + std::to_string(npos) + (npos > n ? "+" : "") +
                               " positives, header says " + std::to_string(n));
    if (npos < n)
        return container_error("Bloom filter has " + std::to_string(npos) + " positives, fewer than the " +
                               std::to_string(n) + " values sent");
    if (npos > limit && !prefix)
        return container_error("Bloom " + std::string(wr::BLOOM_POLICIES[p.policy]) + " filter has more than " +
                               std::to_string(limit) + " positives: more than a filter holding " + std::to_string(n) +
                               " keys has at its own false-positive rate");
    out.resize(n);
    uint64_t* o = reinterpret_cast<uint64_t*>(out.data());
    size_t offset = 0;
    try {
        if (p.policy == 2)
            bl::select_random(P.data(), P.size(), n, p.draw_seed, o);
        else if (p.policy == 3)
            bl::select_conflict(family, P.data(), P.size(), n,
                                p.size, p.k, p.seed, p.draw_seed, o);
        else {
            if (p.policy == 6) offset = npos - n;
            if (p.policy == 5) offset = (npos - n) / 2;
            std::copy(P.begin() + offset, P.begin() + offset + n, o);
        }
    } catch (const std::invalid_argument& e) {
        return container_error(std::string("Bloom decode: ") + e.what());
    }
    return {};
}

// The values of a sparse container (the core's value codecs raw, fp16 and polyfit).
Failure decode_values(const ct::Header& h, const uint8_t* params, const uint8_t* section, std::vector<float>& out) {
    const uint64_t n = h.n, len = h.lengths[ct::VALUE];
    if (h.value_id == 2) {   // PolyFit.decode
        int degree, coef_bytes;
        std::string err = wr::check_polyfit_params(params, h.lengths[ct::VALUE_PARAMS], degree, coef_bytes);
        if (err.empty()) err = wr::check_polyfit_lengths(section, len, n, degree);
        if (!err.empty()) return container_error(err);
        int rc = dr_polyfit_check(section, static_cast<int64_t>(len), static_cast<int64_t>(n), degree, coef_bytes);
        if (rc >= 0) {
            out.resize(n);
            rc = dr_polyfit_decode(section, static_cast<int64_t>(len), static_cast<int64_t>(n), degree, coef_bytes,
                                   out.data());
        }
        if (rc < 0) return container_error(std::string("polyfit value section is invalid: ") + dr_fit_error_message(rc));
        return {};
    }
    if (h.value_id > 2)
        return container_error("container value codec id " + std::to_string(h.value_id) +
                               " has no TensorFlow op (the ops decode raw, fp16 and polyfit values); build the "
                               "pipeline with backend='numpy_function' to decode it");
    const uint64_t width = h.value_id == 0 ? 4 : 2;
    if (len != n * width)
        return container_error(std::string(h.value_id == 0 ? "raw" : "fp16") + " value section has " +
                               std::to_string(len) + " bytes, expected " + std::to_string(n * width));
    out.resize(n);
    if (width == 4) {
        std::memcpy(out.data(), section, 4 * n);
    } else {
        for (uint64_t j = 0; j < n; ++j) {
            uint16_t v;
            std::memcpy(&v, section + 2 * j, 2);
            out[j] = half_to_float(v);
        }
    }
    return {};
}

// Value j belongs to indices[perm[j]]: the values in index order (Pipeline._decode_into).
Failure unpermute(const ct::Header& h, const uint8_t* section, std::vector<float>& values) {
    std::string err = bp::check(h.lengths[ct::PERM], h.perm_width, h.n);
    if (!err.empty()) return container_error(err);
    std::vector<uint64_t> perm(h.n);
    bp::unpack(section, h.lengths[ct::PERM], h.perm_width, h.n, perm.data());
    std::vector<char> seen(h.n, 0);
    for (uint64_t p : perm) {
        if (p >= h.n || seen[p]) return container_error("container permutation section is not a permutation");
        seen[p] = 1;
    }
    std::vector<float> ordered(h.n);
    for (uint64_t j = 0; j < h.n; ++j) ordered[perm[j]] = values[j];
    values.swap(ordered);
    return {};
}

// pipeline._check_finite: a container without the NONFINITE flag must decode to finite values.
Failure check_finite(const ct::Header& h, const float* values, uint64_t n, const char* what) {
    if (h.flags & ct::FLAG_NONFINITE) return {};
    for (uint64_t i = 0; i < n; ++i)
        if (!std::isfinite(values[i]))
            return container_error(std::string("container ") + what +
                                   " hold NaN/Inf but its header does not carry the non-finite flag");
    return {};
}

// Pipeline._decode_into with accumulate: add the container's tensor into target.
Failure add_container(const ct::Header& h, const uint8_t* buf, uint64_t numel, int threads, float* target) {
    const uint8_t* params = buf + h.size;
    const uint8_t* sections = params + h.lengths[ct::INDEX_PARAMS] + h.lengths[ct::VALUE_PARAMS];
    if (h.dense()) {
        std::vector<float> dense(numel);
        std::memcpy(dense.data(), sections, 4 * numel);
        Failure f = check_finite(h, dense.data(), numel, "dense section");
        if (f.failed()) return f;
        for (uint64_t i = 0; i < numel; ++i) target[i] += dense[i];
        return {};
    }
    std::vector<int64_t> indices;
    std::vector<float> values;
    Failure f = decode_indices(h, params, sections, numel, threads, indices);
    if (!f.failed()) f = decode_values(h, params + h.lengths[ct::INDEX_PARAMS], sections + h.lengths[ct::INDEX], values);
    if (!f.failed()) f = check_finite(h, values.data(), values.size(), "values");
    if (!f.failed() && h.permuted())
        f = unpermute(h, sections + h.lengths[ct::INDEX] + h.lengths[ct::VALUE], values);
    if (f.failed()) return f;
    const int64_t n = static_cast<int64_t>(h.n);
    if (h.index_id == 1) {   // Bloom: strictly ascending, checked by the kernel
        std::string err = dr_select::scatter_add_checked(target, static_cast<int64_t>(numel), indices.data(),
                                                         values.data(), n, threads);
        return err.empty() ? Failure{} : container_error(err);
    }
    if (n) {   // kernels.check_indices(ascending=False)
        std::vector<int64_t> sorted(indices);
        std::sort(sorted.begin(), sorted.end());
        for (int64_t j = 1; j < n; ++j)
            if (sorted[j] == sorted[j - 1]) return container_error("container repeats an index");
        if (sorted[0] < 0 || static_cast<uint64_t>(sorted[n - 1]) >= numel)
            return container_error("container index out of range for a tensor of " + std::to_string(numel) +
                                   " elements");
    }
    dr_select::scatter_add(target, indices.data(), values.data(), n, threads);
    return {};
}

class DecodeOp : public OpKernel {
 public:
    explicit DecodeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
        std::vector<int64_t> shape;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("count", &count_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("single", &single_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("shape", &shape));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("check_shape", &check_shape_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("max_numel", &max_numel_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("threads", &threads_));
        for (int64_t s : shape) expected_.push_back(static_cast<uint64_t>(s));
    }

    void Compute(OpKernelContext* ctx) override {
        tensorflow::port::ScopedDontFlushDenormal keep_denormals;
        const auto start = std::chrono::steady_clock::now();
        const Tensor& input = ctx->input(0);
        const uint8_t* buf = input.flat<uint8_t>().data();
        const size_t len = static_cast<size_t>(input.NumElements());
        std::vector<std::pair<size_t, size_t>> parts;
        if (single_) {
            parts.emplace_back(0, len);
        } else {
            std::string err = ct::split(buf, len, parts);
            if (!err.empty()) return fail(ctx, "ContainerError", err);
            if (count_ >= 0 && static_cast<int64_t>(parts.size()) != count_)
                return fail(ctx, "CommunicationError", "allgather returned " + std::to_string(parts.size()) +
                                                           " containers for " + std::to_string(count_) + " ranks");
            if (parts.empty()) return fail(ctx, "CommunicationError", "no containers to decode");
        }
        bool have_shape = check_shape_;
        std::vector<uint64_t> expected = expected_;
        float* target = nullptr;
        for (size_t rank = 0; rank < parts.size(); ++rank) {
            const std::string where = single_ ? "" : "rank " + std::to_string(rank) + ": ";
            ct::Header h;
            uint64_t numel = 0;
            bool mismatch = false;
            std::string err = ct::unpack(buf + parts[rank].first, parts[rank].second, h, numel,
                                         have_shape ? &expected : nullptr, static_cast<uint64_t>(max_numel_), &mismatch);
            if (!err.empty()) return fail(ctx, mismatch ? "CommunicationError" : "ContainerError", where + err);
            if (!target) {
                TensorShape shape;
                for (uint64_t s : h.shape) shape.AddDim(static_cast<int64_t>(s));
                Tensor* out = nullptr;
                OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
                target = out->flat<float>().data();
                std::fill(target, target + numel, 0.0f);
                expected = h.shape;
                have_shape = true;
            }
            Failure f = add_container(h, buf + parts[rank].first, numel, threads_, target);
            if (f.failed()) return fail(ctx, f.kind, where + f.message);
        }
        Tensor* stats = nullptr;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({STATS}), &stats));
        auto s = stats->flat<int64_t>();
        for (int i = 0; i < STATS; ++i) s(i) = 0;
        s(DECODED) = static_cast<int64_t>(parts.size());
        s(DECODE_NS) = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
                           .count();
    }

 private:
    int64_t count_ = -1, max_numel_ = 1;
    bool single_ = false, check_shape_ = false;
    std::vector<uint64_t> expected_;
    int threads_ = 1;
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("DeepReduceEncode").Device(DEVICE_CPU), EncodeOp);
REGISTER_KERNEL_BUILDER(Name("DeepReduceDecode").Device(DEVICE_CPU), DecodeOp);
