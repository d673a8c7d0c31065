// TensorFlow custom ops over the Fit-Poly kernel of fit.h (the C API the pybind11 module wraps
// too): encode sorted values into the piece-wise Legendre payload, and decode it. Errors of the
// kernel (negative DR_FIT_E* codes) fail the op with InvalidArgument and the kernel's message.
#include <cstdint>
#include <string>
#include <vector>

#include "fit.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;

REGISTER_OP("DeepReduceFitEncode")
    .Input("values: float")
    .Attr("degree: int >= 0")
    .Attr("max_segments: int >= 0")
    .Attr("min_points: int >= 1")
    .Attr("coef_bytes: int = 4")
    .Output("perm: int64")
    .Output("payload: uint8")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
        c->set_output(0, c->input(0));
        c->set_output(1, c->Vector(c->UnknownDim()));
        return tensorflow::OkStatus();
    })
    .Doc("Fit-Poly encode: the descending-sort permutation and the payload (deepreduce polyfit wire layout).");

REGISTER_OP("DeepReduceFitDecode")
    .Input("payload: uint8")
    .Input("n: int64")
    .Attr("degree: int >= 0")
    .Attr("coef_bytes: int = 4")
    .Output("values: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
        c->set_output(0, c->Vector(c->UnknownDim()));
        return tensorflow::OkStatus();
    })
    .Doc("Fit-Poly decode: n float32 values in sorted (descending) order.");

namespace {

class FitEncodeOp : public OpKernel {
 public:
    explicit FitEncodeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
        OP_REQUIRES_OK(ctx, ctx->GetAttr("degree", &degree_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("max_segments", &max_segments_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("min_points", &min_points_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("coef_bytes", &coef_bytes_));
        OP_REQUIRES(ctx, coef_bytes_ == 4 || coef_bytes_ == 8, InvalidArgument("coef_bytes must be 4 or 8"));
    }

    void Compute(OpKernelContext* ctx) override {
        const Tensor& values = ctx->input(0);
        OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsVector(values.shape()),
                    InvalidArgument("values must be a 1-D tensor"));
        const int64_t n = values.NumElements();
        Tensor* perm = nullptr;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &perm));
        const int64_t bound = dr_polyfit_payload_bound(n, degree_, max_segments_, coef_bytes_);
        OP_REQUIRES(ctx, bound >= 0, InvalidArgument("polyfit: ", dr_fit_error_message(static_cast<int>(bound))));
        std::vector<uint8_t> buf(static_cast<size_t>(bound));
        const int64_t len = dr_polyfit_encode(values.flat<float>().data(), n, degree_, max_segments_, min_points_,
                                              coef_bytes_, perm->flat<int64_t>().data(), buf.data(), bound);
        OP_REQUIRES(ctx, len >= 0, InvalidArgument("polyfit encode: ", dr_fit_error_message(static_cast<int>(len))));
        Tensor* payload = nullptr;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({len}), &payload));
        std::copy(buf.begin(), buf.begin() + len, payload->flat<uint8_t>().data());
    }

 private:
    int degree_, max_segments_, min_points_, coef_bytes_;
};

class FitDecodeOp : public OpKernel {
 public:
    explicit FitDecodeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
        OP_REQUIRES_OK(ctx, ctx->GetAttr("degree", &degree_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("coef_bytes", &coef_bytes_));
        OP_REQUIRES(ctx, coef_bytes_ == 4 || coef_bytes_ == 8, InvalidArgument("coef_bytes must be 4 or 8"));
    }

    void Compute(OpKernelContext* ctx) override {
        const Tensor& payload = ctx->input(0);
        const Tensor& n_in = ctx->input(1);
        OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsVector(payload.shape()),
                    InvalidArgument("payload must be a 1-D tensor"));
        OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsScalar(n_in.shape()), InvalidArgument("n must be a scalar"));
        const int64_t n = n_in.scalar<int64_t>()();
        OP_REQUIRES(ctx, n >= 0, InvalidArgument("n must be non-negative"));
        const int ok = dr_polyfit_check(payload.flat<uint8_t>().data(), payload.NumElements(), n, degree_, coef_bytes_);
        OP_REQUIRES(ctx, ok == 0, InvalidArgument("polyfit decode: ", dr_fit_error_message(ok)));
        Tensor* out = nullptr;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &out));
        const int rc = dr_polyfit_decode(payload.flat<uint8_t>().data(), payload.NumElements(), n, degree_,
                                         coef_bytes_, out->flat<float>().data());
        OP_REQUIRES(ctx, rc == 0, InvalidArgument("polyfit decode: ", dr_fit_error_message(rc)));
    }

 private:
    int degree_, coef_bytes_;
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("DeepReduceFitEncode").Device(DEVICE_CPU), FitEncodeOp);
REGISTER_KERNEL_BUILDER(Name("DeepReduceFitDecode").Device(DEVICE_CPU), FitDecodeOp);
