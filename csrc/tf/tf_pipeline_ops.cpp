// The TensorFlow pipeline ops: glue between TensorFlow tensors and the C++ pipeline subset
// (csrc/pipeline/pipeline.h). DeepReduceEncode encodes a gradient into a container, updating the
// tensor's error-feedback residual in place inside its resource variable; DeepReduceDecode decodes
// (and sums) containers. deepreduce/tensorflow/ops.py builds their attributes from the core pipeline
// (deepreduce/backend/native_pipeline.py) and holds the variables.
//
// TF runs op kernels with denormals flushed to zero; these compute with the default floating-point
// environment, as the core does anywhere else (tensorflow/fpenv.py does the same for py_funcs).
//
// A deepreduce::Error fails the op with InvalidArgument whose message starts with the deepreduce
// error class ("ContainerError: ...") followed by the core's own text; ops.py raises that class.
#include <chrono>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "bloom_wire.h"
#include "common/error.h"
#include "pipeline.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/denormal.h"

namespace ct = deepreduce::container;
namespace pl = deepreduce::pipeline;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::shape_inference::InferenceContext;

// Layout of the int64 statistics vector both ops return (added to the pipeline's counters).
enum Stat {
    ENCODED,
    DECODED,
    DENSE_BYTES,
    WIRE_BYTES,
    INDEX_BYTES,
    VALUE_BYTES,
    PERM_BYTES,
    HEADER_BYTES,
    ENCODE_NS,
    DECODE_NS,
    STATS
};

REGISTER_OP("DeepReduceEncode")
    .Input("grad: float")
    .Input("step: int64")
    .Input("residual: resource")
    .Output("payload: uint8")
    .Output("stats: int64")
    .Attr("tensor_name: string")
    .Attr("digest: string")
    .Attr("min_numel: int >= 0")
    .Attr("sparsifier: {'topk', 'threshold'} = 'topk'")
    .Attr("ratio_bits: int = 0")
    .Attr("threshold: float = 0")
    .Attr("error_feedback: bool")
    .Attr("index: {'raw', 'bloom', 'elias_fano'}")
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
        c->set_output(1, c->Vector(STATS));
        return tensorflow::OkStatus();
    })
    .Doc(
        "One container for grad (deepreduce Pipeline.encode). `residual` is the float32 resource variable "
        "of the tensor's error-feedback residual (empty: none yet), updated in place; unused without "
        "error feedback.");

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
    .Doc(
        "The sum of the tensors of the concatenated containers in payload (Pipeline.decode_sum; "
        "single: exactly one container, Pipeline.decode).");

namespace {

// A TensorFlow failure inside an allocator the pipeline calls, carried out of it.
struct TfFailure {
    absl::Status status;
};

double bits_to_double(int64_t bits) {
    double d;
    std::memcpy(&d, &bits, sizeof(d));
    return d;
}

Tensor* allocate_output(OpKernelContext* ctx, int index, const TensorShape& shape) {
    Tensor* out = nullptr;
    const absl::Status status = ctx->allocate_output(index, shape, &out);
    if (!status.ok()) throw TfFailure{status};
    return out;
}

int64_t nanoseconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

// Runs one op body: deepreduce errors become InvalidArgument("<class>: <text>"). No exception may
// leave a kernel (TensorFlow is built without them: one that escapes ends the process), so memory
// the body could not get (std::bad_alloc) and any other C++ exception become a DeepReduceError too.
template <class Body>
void run_body(OpKernelContext* ctx, Body body) {
    try {
        body();
    } catch (const deepreduce::Error& e) {
        ctx->CtxFailure(tensorflow::errors::InvalidArgument(std::string(e.kind_name()) + ": " + e.what()));
    } catch (const TfFailure& f) {
        ctx->CtxFailure(f.status);
    } catch (const std::bad_alloc&) {
        ctx->CtxFailure(
            tensorflow::errors::InvalidArgument("DeepReduceError: out of memory in the deepreduce op "
                                                "(std::bad_alloc)"));
    } catch (const std::exception& e) {
        ctx->CtxFailure(tensorflow::errors::InvalidArgument(std::string("DeepReduceError: ") + e.what()));
    }
}

class EncodeOp : public OpKernel {
  public:
    explicit EncodeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
        int64_t ratio_bits, lam_bits, hash_seed, k;
        std::string sparsifier, index, value, policy;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("tensor_name", &name_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("digest", &config_.digest));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("min_numel", &config_.min_numel));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("sparsifier", &sparsifier));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("ratio_bits", &ratio_bits));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("threshold", &config_.threshold));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("error_feedback", &config_.error_feedback));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("index", &index));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("policy", &policy));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("keys_per_block_bits", &lam_bits));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("k", &k));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("hash_seed", &hash_seed));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("value", &value));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("degree", &config_.degree));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("segments", &config_.segments));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("min_points", &config_.min_points));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("coef_bytes", &config_.coef_bytes));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("threads", &config_.threads));
        config_.ratio = bits_to_double(ratio_bits);
        config_.keys_per_block = bits_to_double(lam_bits);
        config_.k = static_cast<int>(k);
        config_.hash_seed = static_cast<uint64_t>(hash_seed);
        try {
            config_.sparsifier = pl::sparsifier_named(sparsifier);
            config_.index = pl::index_named(index);
            config_.value = pl::value_named(value);
            config_.policy = deepreduce::bloom::policy_code(policy);
            config_.check();
        } catch (const deepreduce::Error& e) {
            ctx->CtxFailure(tensorflow::errors::InvalidArgument(e.what()));
        }
    }

    void Compute(OpKernelContext* ctx) override {
        tensorflow::port::ScopedDontFlushDenormal keep_denormals;
        const auto start = std::chrono::steady_clock::now();
        const Tensor& grad = ctx->input(0);
        const int64_t step = ctx->input(1).scalar<int64_t>()();
        std::vector<uint64_t> shape;
        for (int d = 0; d < grad.dims(); ++d) shape.push_back(static_cast<uint64_t>(grad.dim_size(d)));
        tensorflow::core::RefCountPtr<tensorflow::Var> var;
        if (config_.error_feedback)
            OP_REQUIRES_OK(ctx, tensorflow::LookupResource(ctx, tensorflow::HandleFromInput(ctx, 2), &var));
        run_body(ctx, [&] {
            ct::Header h;
            Tensor* payload = nullptr;
            const pl::PayloadAllocator allocate = [&](size_t bytes) {
                payload = allocate_output(ctx, 0, TensorShape({static_cast<int64_t>(bytes)}));
                return payload->flat<uint8_t>().data();
            };
            if (var) {
                tensorflow::mutex_lock lock(*var->mu());
                pl::Residual residual;  // updated in place (prior = data)
                residual.numel = writable_residual(ctx, var.get(), &residual.data);
                residual.prior = residual.data;
                const pl::ResidualAllocator create = [&](int64_t n) { return new_residual(ctx, var.get(), n); };
                h = pl::encode(config_, name_, step, grad.flat<float>().data(), shape, residual, create, allocate);
            } else {
                h = pl::encode(config_, name_, step, grad.flat<float>().data(), shape, pl::Residual{}, nullptr,
                               allocate);
            }
            auto s = allocate_output(ctx, 1, TensorShape({STATS}))->flat<int64_t>();
            const int64_t total = payload->NumElements();
            const uint64_t sections = h.lengths[ct::INDEX] + h.lengths[ct::VALUE] + h.lengths[ct::PERM];
            for (int i = 0; i < STATS; ++i) s(i) = 0;
            s(ENCODED) = 1;
            s(DENSE_BYTES) = 4 * grad.NumElements();
            s(WIRE_BYTES) = total;
            s(INDEX_BYTES) = static_cast<int64_t>(h.lengths[ct::INDEX]);
            s(VALUE_BYTES) = static_cast<int64_t>(h.lengths[ct::VALUE]);
            s(PERM_BYTES) = static_cast<int64_t>(h.lengths[ct::PERM]);
            s(HEADER_BYTES) = total - static_cast<int64_t>(sections);
            s(ENCODE_NS) = nanoseconds_since(start);
        });
    }

  private:
    // The variable's residual, written in place: its element count (0 before the tensor's first
    // finite step). A buffer another tensor still shares (a read of the variable kept alive) is
    // copied first, so what was read never changes under the reader.
    static int64_t writable_residual(OpKernelContext* ctx, tensorflow::Var* var, float** data) {
        Tensor* t = var->tensor();
        if (!var->is_initialized || t->dtype() != tensorflow::DT_FLOAT || t->NumElements() == 0) return 0;
        if (!t->RefCountIsOne()) {
            Tensor copy;
            const absl::Status status = ctx->allocate_temp(tensorflow::DT_FLOAT, t->shape(), &copy);
            if (!status.ok()) throw TfFailure{status};
            std::memcpy(copy.flat<float>().data(), t->flat<float>().data(), sizeof(float) * t->NumElements());
            *t = copy;
        }
        *data = t->flat<float>().data();
        return t->NumElements();
    }

    // A fresh residual of n elements, held by the variable from now on.
    static float* new_residual(OpKernelContext* ctx, tensorflow::Var* var, int64_t n) {
        Tensor fresh;
        const absl::Status status = ctx->allocate_temp(tensorflow::DT_FLOAT, TensorShape({n}), &fresh);
        if (!status.ok()) throw TfFailure{status};
        *var->tensor() = fresh;
        var->is_initialized = true;
        return var->tensor()->flat<float>().data();
    }

    std::string name_;
    pl::EncodeConfig config_;
};

class DecodeOp : public OpKernel {
  public:
    explicit DecodeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
        std::vector<int64_t> shape;
        int64_t max_numel;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("count", &config_.count));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("single", &config_.single));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("shape", &shape));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("check_shape", &config_.check_shape));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("max_numel", &max_numel));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("threads", &config_.threads));
        for (int64_t s : shape) config_.shape.push_back(static_cast<uint64_t>(s));
        config_.max_numel = static_cast<uint64_t>(max_numel);
    }

    void Compute(OpKernelContext* ctx) override {
        tensorflow::port::ScopedDontFlushDenormal keep_denormals;
        const auto start = std::chrono::steady_clock::now();
        const Tensor& input = ctx->input(0);
        run_body(ctx, [&] {
            const size_t containers = pl::decode_sum(
                config_, input.flat<uint8_t>().data(), static_cast<size_t>(input.NumElements()),
                [&](const std::vector<uint64_t>& dims, uint64_t numel) {
                    TensorShape shape;
                    for (uint64_t d : dims) shape.AddDim(static_cast<int64_t>(d));
                    try {
                        return allocate_output(ctx, 0, shape)->flat<float>().data();
                    } catch (const TfFailure& f) {  // the tensor the container claims
                        throw deepreduce::Error(
                            deepreduce::ErrorKind::CONTAINER,
                            "container claims a tensor of " + std::to_string(numel) +
                                " elements, which TensorFlow could not allocate: " + std::string(f.status.message()));
                    }
                });
            auto s = allocate_output(ctx, 1, TensorShape({STATS}))->flat<int64_t>();
            for (int i = 0; i < STATS; ++i) s(i) = 0;
            s(DECODED) = static_cast<int64_t>(containers);
            s(DECODE_NS) = nanoseconds_since(start);
        });
    }

  private:
    pl::DecodeConfig config_;
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("DeepReduceEncode").Device(tensorflow::DEVICE_CPU).HostMemory("residual"), EncodeOp);
REGISTER_KERNEL_BUILDER(Name("DeepReduceDecode").Device(tensorflow::DEVICE_CPU), DecodeOp);
