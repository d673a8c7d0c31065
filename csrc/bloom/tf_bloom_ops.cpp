// TensorFlow custom ops over the Bloom kernels of bloom.h (the functions the pybind11 module
// wraps too): build a filter, query every position of a tensor, and select r positives with a
// DeepReduce policy, all with the blocked hash family of container format v2 (`blocks` 512-bit
// blocks; v1 containers are decoded by the core). Seeds are uint64 carried in int64 tensors (same
// bits). Every argument is checked; bad input fails the op with InvalidArgument, it never reads
// out of bounds.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "bloom.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace bl = deepreduce::bloom;
using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;

REGISTER_OP("DeepReduceBloomBuild")
    .Input("indices: int64")
    .Input("blocks: int64")
    .Input("k: int64")
    .Input("seed: int64")
    .Output("bits: uint8")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
        c->set_output(0, c->Vector(c->UnknownDim()));
        return tensorflow::OkStatus();
    })
    .Doc("Blocked Bloom filter of 64 * blocks bytes (bit j at bit j%8 of byte j/8) holding `indices`.");

REGISTER_OP("DeepReduceBloomQuery")
    .Input("bits: uint8")
    .Input("blocks: int64")
    .Input("k: int64")
    .Input("seed: int64")
    .Input("d: int64")
    .Input("limit: int64")
    .Output("positives: int64")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
        c->set_output(0, c->Vector(c->UnknownDim()));
        return tensorflow::OkStatus();
    })
    .Doc("The first min(|P|, limit + 1) positions P in [0, d) whose k bits are set, ascending.");

REGISTER_OP("DeepReduceBloomSelect")
    .Input("positives: int64")
    .Input("r: int64")
    .Input("blocks: int64")
    .Input("k: int64")
    .Input("seed: int64")
    .Input("draw_seed: int64")
    .Attr("policy: {'naive', 'p0', 'p1', 'p2', 'leftmost', 'middle', 'rightmost'}")
    .Output("chosen: int64")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
        c->set_output(0, c->Vector(c->UnknownDim()));
        return tensorflow::OkStatus();
    })
    .Doc("The positives a DeepReduce Bloom policy transmits (p0: all of them), ascending.");

namespace {

bool scalar_int64(OpKernelContext* ctx, int input, const char* name, int64_t* out) {
    const Tensor& t = ctx->input(input);
    if (!tensorflow::TensorShapeUtils::IsScalar(t.shape())) {
        ctx->CtxFailure(InvalidArgument(std::string(name) + " must be a scalar"));
        return false;
    }
    *out = t.scalar<int64_t>()();
    return true;
}

// blocks, k, seed as the kernels expect them; false (op failed) when out of range.
bool filter_args(OpKernelContext* ctx, int first, uint64_t* blocks, int* k, uint64_t* seed) {
    int64_t m_in, k_in, seed_in;
    if (!scalar_int64(ctx, first, "blocks", &m_in) || !scalar_int64(ctx, first + 1, "k", &k_in) ||
        !scalar_int64(ctx, first + 2, "seed", &seed_in))
        return false;
    if (m_in < 0 || static_cast<uint64_t>(m_in) > bl::blocked::MAX_BLOCKS || k_in < 1 || k_in > bl::MAX_K) {
        ctx->CtxFailure(InvalidArgument("Bloom filter needs blocks in [0, 2^31 - 1] and k in [1, 64]; got blocks = ",
                                        m_in, ", k = ", k_in));
        return false;
    }
    *blocks = static_cast<uint64_t>(m_in);
    *k = static_cast<int>(k_in);
    *seed = static_cast<uint64_t>(seed_in);
    return true;
}

bool vector_input(OpKernelContext* ctx, int input, const char* name) {
    if (!tensorflow::TensorShapeUtils::IsVector(ctx->input(input).shape())) {
        ctx->CtxFailure(InvalidArgument(std::string(name) + " must be a 1-D tensor"));
        return false;
    }
    return true;
}

// Runs a kernel, failing the op with InvalidArgument on its std::invalid_argument.
template <class F>
void run_kernel(OpKernelContext* ctx, const char* what, F fn) {
    try {
        fn();
    } catch (const std::invalid_argument& e) {
        ctx->CtxFailure(InvalidArgument(what, ": ", e.what()));
    }
}

class BloomBuildOp : public OpKernel {
 public:
    explicit BloomBuildOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

    void Compute(OpKernelContext* ctx) override {
        uint64_t blocks, seed;
        int k;
        if (!vector_input(ctx, 0, "indices") || !filter_args(ctx, 1, &blocks, &k, &seed)) return;
        const Tensor& idx = ctx->input(0);
        const int64_t n = idx.NumElements();
        OP_REQUIRES(ctx, blocks > 0 || n == 0, InvalidArgument("blocks must be positive to insert indices"));
        auto flat = idx.flat<int64_t>();
        for (int64_t i = 0; i < n; ++i)
            OP_REQUIRES(ctx, flat(i) >= 0, InvalidArgument("Bloom indices must be non-negative"));
        const int64_t nbytes = static_cast<int64_t>(blocks * bl::blocked::BLOCK_BYTES);
        Tensor* out = nullptr;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nbytes}), &out));
        uint8_t* bits = out->flat<uint8_t>().data();
        std::fill(bits, bits + nbytes, 0);
        run_kernel(ctx, "Bloom build", [&] {
            bl::blocked::build(reinterpret_cast<const uint64_t*>(flat.data()), static_cast<size_t>(n), blocks, k, seed,
                               bits, 1);
        });
    }
};

class BloomQueryOp : public OpKernel {
 public:
    explicit BloomQueryOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

    void Compute(OpKernelContext* ctx) override {
        uint64_t blocks, seed;
        int k;
        int64_t d, limit;
        if (!vector_input(ctx, 0, "bits") || !filter_args(ctx, 1, &blocks, &k, &seed) ||
            !scalar_int64(ctx, 4, "d", &d) || !scalar_int64(ctx, 5, "limit", &limit))
            return;
        const Tensor& bits = ctx->input(0);
        OP_REQUIRES(ctx, static_cast<uint64_t>(bits.NumElements()) == blocks * bl::blocked::BLOCK_BYTES,
                    InvalidArgument("Bloom filter has ", bits.NumElements(), " bytes, expected ",
                                    blocks * bl::blocked::BLOCK_BYTES, " for blocks = ", blocks));
        OP_REQUIRES(ctx, d >= 0 && limit >= 0, InvalidArgument("d and limit must be non-negative"));
        std::vector<uint64_t> found;
        run_kernel(ctx, "Bloom query", [&] {
            bl::blocked::query(bits.flat<uint8_t>().data(), blocks, k, seed, static_cast<uint64_t>(d),
                               static_cast<uint64_t>(limit), 1, found);
        });
        if (!ctx->status().ok()) return;
        Tensor* out = nullptr;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({static_cast<int64_t>(found.size())}), &out));
        std::copy(found.begin(), found.end(), reinterpret_cast<uint64_t*>(out->flat<int64_t>().data()));
    }
};

class BloomSelectOp : public OpKernel {
 public:
    explicit BloomSelectOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
        OP_REQUIRES_OK(ctx, ctx->GetAttr("policy", &policy_));
    }

    void Compute(OpKernelContext* ctx) override {
        int64_t r, draw_in;
        uint64_t blocks, seed;
        int k;
        if (!vector_input(ctx, 0, "positives") || !scalar_int64(ctx, 1, "r", &r) ||
            !filter_args(ctx, 2, &blocks, &k, &seed) || !scalar_int64(ctx, 5, "draw_seed", &draw_in))
            return;
        const Tensor& pos = ctx->input(0);
        const int64_t np = pos.NumElements();
        const uint64_t* P = reinterpret_cast<const uint64_t*>(pos.flat<int64_t>().data());
        if (policy_ == "p0") r = np;
        OP_REQUIRES(ctx, r >= 0 && r <= np,
                    InvalidArgument("Bloom ", policy_, ": ", r, " indices requested from ", np, " positives"));
        Tensor* out = nullptr;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({r}), &out));
        uint64_t* chosen = reinterpret_cast<uint64_t*>(out->flat<int64_t>().data());
        int64_t offset = 0;
        if (policy_ == "p1") {
            run_kernel(ctx, "Bloom p1", [&] {
                bl::select_random(P, static_cast<size_t>(np), static_cast<size_t>(r), static_cast<uint64_t>(draw_in),
                                  chosen);
            });
            return;
        }
        if (policy_ == "p2") {
            run_kernel(ctx, "Bloom p2", [&] {
                bl::select_conflict(bl::Family::blocked, P, static_cast<size_t>(np), static_cast<size_t>(r), blocks, k,
                                    seed, static_cast<uint64_t>(draw_in), chosen);
            });
            return;
        }
        if (policy_ == "rightmost") offset = np - r;
        if (policy_ == "middle") offset = (np - r) / 2;
        std::copy(P + offset, P + offset + r, chosen);  // naive, leftmost, p0 (offset 0)
    }

 private:
    std::string policy_;
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("DeepReduceBloomBuild").Device(DEVICE_CPU), BloomBuildOp);
REGISTER_KERNEL_BUILDER(Name("DeepReduceBloomQuery").Device(DEVICE_CPU), BloomQueryOp);
REGISTER_KERNEL_BUILDER(Name("DeepReduceBloomSelect").Device(DEVICE_CPU), BloomSelectOp);
