// The subset of deepreduce's Pipeline (deepreduce/pipeline.py) that runs in C++: encode one
// float32 tensor into a container and decode (and sum) containers, for the configs whose every
// stage exists in C++ -- error feedback with Top-r (fused into the compensation pass) or threshold
// selection (csrc/select), raw, Elias-Fano (elias_fano.h) or Bloom indices with every policy
// (csrc/bloom), raw, fp16 or
// polyfit values (csrc/fit, fp16.h) -- with the core's bytes and error texts. The TensorFlow ops
// (csrc/tf) are glue around these two functions and the pybind11 module deepreduce._pipeline binds
// them (tests compare both with deepreduce.build(config).encode byte for byte).
//
// Errors: deepreduce::Error (common/error.h); the kind names the core's error class.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "container.h"

namespace deepreduce {
namespace pipeline {

enum class Sparsifier { TOPK, THRESHOLD };
enum class IndexCodec { RAW, BLOOM, ELIAS_FANO };
enum class ValueCodec { RAW, FP16, POLYFIT };

// The stage of a core component id ("topk", "bloom", "polyfit", ...); ErrorKind::ARGUMENT for an
// id the C++ pipeline does not have.
Sparsifier sparsifier_named(const std::string& id);
IndexCodec index_named(const std::string& id);
ValueCodec value_named(const std::string& id);

// One pipeline's encode settings: what deepreduce/backend/native_pipeline.py reads off a core
// Pipeline's components.
struct EncodeConfig {
    std::string digest;     // Pipeline.config_digest (16 bytes; the header carries 8)
    int64_t min_numel = 0;  // smaller tensors travel dense
    Sparsifier sparsifier = Sparsifier::TOPK;
    double ratio = 0;             // Top-r: r = count_for(ratio, numel)
    float threshold = 0;          // threshold: |x| >= threshold, compared in float32
    bool error_feedback = false;  // residual memory (ResidualMemory)
    IndexCodec index = IndexCodec::RAW;
    int policy = 1;             // Bloom: bloom::Policy
    double keys_per_block = 0;  // Bloom: filter_shape's lam
    int k = 1;                  // Bloom: probes per index
    uint64_t hash_seed = 0;     // Bloom: hash seed
    ValueCodec value = ValueCodec::RAW;
    int degree = 5, segments = 0, min_points = 6, coef_bytes = 4;  // polyfit
    int threads = 1;

    // ErrorKind::ARGUMENT for settings no core pipeline has.
    void check() const;
};

// Storage the caller owns: the payload of one container (called once, with its final size),
// and the residual of a tensor first met with error feedback (called once per tensor).
using PayloadAllocator = std::function<uint8_t*(size_t bytes)>;
using ResidualAllocator = std::function<float*(int64_t numel)>;

// A tensor's error-feedback residual: `data` (numel values; null when the tensor has none yet)
// receives this step's compensated gradient prior + grad and is then settled; `prior` is `data`
// itself (in place) or the residual before the step, read and left intact (Memory.step_buffers:
// a step that may be undone keeps it instead of copying it).
struct Residual {
    float* data = nullptr;
    const float* prior = nullptr;
    int64_t numel = 0;
};

// Pipeline.encode of one float32 tensor `grad` of `shape`, named `name`, at `step`, with the
// tensor's residual (created through new_residual on its first finite step). Returns the
// container's header (its section lengths give the statistics).
container::Header encode(const EncodeConfig& config, const std::string& name, int64_t step, const float* grad,
                         const std::vector<uint64_t>& shape, const Residual& residual,
                         const ResidualAllocator& new_residual, const PayloadAllocator& payload);

// Storage for the container of shard j (called once per shard, in shard order).
using ShardAllocator = std::function<uint8_t*(size_t shard, size_t bytes)>;

// Pipeline.encode_shards of one flat float32 tensor of n elements: compensation and selection
// once over the whole tensor (as encode), then one container per shard [bounds[j], bounds[j+1])
// of the selected entries inside it (indices relative to bounds[j], seeded as "name#j"); the
// residual is settled once. Selected values made non-finite by the compensation raise
// ErrorKind::OVERFLOW before any residual is settled (the core's CompensationOverflow).
std::vector<container::Header> encode_shards(const EncodeConfig& config, const std::string& name, int64_t step,
                                             const float* grad, int64_t n, const std::vector<int64_t>& bounds,
                                             const Residual& residual, const ResidualAllocator& new_residual,
                                             const ShardAllocator& payload);

struct DecodeConfig {
    int64_t count = -1;        // containers expected (the ranks); -1: any number
    bool single = false;       // exactly one container (Pipeline.decode), no split
    bool check_shape = false;  // refuse another shape than `shape`
    std::vector<uint64_t> shape;
    uint64_t max_numel = ~uint64_t(0);  // without a shape: refuse larger claims
    int threads = 1;
};

// The tensor a decoded container sum is written to, allocated by the caller from the first
// header's shape (numel floats, filled here).
using TensorAllocator = std::function<float*(const std::vector<uint64_t>& shape, uint64_t numel)>;

// Pipeline.decode_sum over the concatenated containers of buf (Pipeline.decode with `single`):
// the sum of their tensors, written to the tensor from `tensor`. Returns the number of containers.
size_t decode_sum(const DecodeConfig& config, const uint8_t* buf, size_t len, const TensorAllocator& tensor);

// One container where it lies in a received buffer (never copied out of it).
struct Part {
    const uint8_t* data;
    size_t size;
};

// decode_sum over containers given one by one (`single` and `count` do not apply): the sum of
// what a collective received, decoded where it lies. Returns the number of containers.
size_t decode_sum(const DecodeConfig& config, const std::vector<Part>& parts, const TensorAllocator& tensor);

// The sparse all-reduce's last phase: container j holds shard [bounds[j], bounds[j+1]) of a flat
// tensor (Pipeline.decode with that shard's shape, checked) and is written to out + bounds[j],
// each value divided by `divisor` (averaging: every position is written once, so dividing what
// is written equals dividing the whole tensor afterwards, without a pass over its zeros).
void decode_shards(const std::vector<Part>& parts, const std::vector<int64_t>& bounds, float* out, int threads,
                   float divisor = 1.0f);

}  // namespace pipeline
}  // namespace deepreduce
