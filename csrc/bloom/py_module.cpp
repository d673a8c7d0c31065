// pybind11 bindings of the Bloom kernels (bloom.h) and the codec's wire rules (bloom_wire.h) over
// NumPy buffers and bytes: deepreduce._bloom.
//
// Every argument is checked before a kernel runs (common/py_args.h); filters must have exactly
// the bytes their size implies. The kernels run without the GIL, on `threads` threads where the
// work is large enough. The Python codec turns ValueError/TypeError into deepreduce errors.
#include <string>
#include <vector>

#include "bloom.h"
#include "bloom_wire.h"
#include "common/py_args.h"

namespace py = pybind11;
namespace bl = deepreduce::bloom;
using deepreduce::py_args::index_array;
using deepreduce::py_args::int_arg;
using deepreduce::py_args::threads_arg;
using deepreduce::py_args::U64Array;

namespace {

constexpr uint64_t U64_MAX = ~uint64_t(0);

int k_arg(const py::handle& obj) {
    return static_cast<int>(int_arg(obj, "k", 1, bl::MAX_K));
}

// `size` is the block count (blocked) or m (splitmix).
bl::Family family_arg(const std::string& family) {
    if (family == "blocked") return bl::Family::BLOCKED;
    if (family == "splitmix") return bl::Family::SPLITMIX;
    throw py::value_error("family must be 'blocked' or 'splitmix', got '" + family + "'");
}

uint64_t size_arg(const py::handle& obj, bl::Family family) {
    return family == bl::Family::BLOCKED ? int_arg(obj, "blocks", 0, bl::blocked::MAX_BLOCKS)
                                         : int_arg(obj, "m", 0, U64_MAX);
}

// The filter bytes a family's size implies (bloom_wire.h Params::filter_bytes).
uint64_t filter_bytes(bl::Family family, uint64_t size) {
    bl::Params p;
    p.family = family;
    p.size = size;
    return p.filter_bytes();
}

// The bytes of a filter argument, which must be exactly the filter of its family and size.
std::string filter_arg(const py::bytes& data, bl::Family family, uint64_t size) {
    std::string bits = data;
    if (bits.size() != filter_bytes(family, size))
        throw py::value_error("Bloom filter has " + std::to_string(bits.size()) + " bytes, expected " +
                              std::to_string(filter_bytes(family, size)) + " for " +
                              (family == bl::Family::BLOCKED ? "blocks = " : "m = ") + std::to_string(size));
    return bits;
}

U64Array to_array(const std::vector<uint64_t>& v) {
    U64Array out(static_cast<py::ssize_t>(v.size()));
    if (!v.empty()) std::copy(v.begin(), v.end(), out.mutable_data());
    return out;
}

// The positives of P (all P.count of them), ascending.
U64Array to_array(const bl::Positives& P) {
    U64Array out(static_cast<py::ssize_t>(P.count));
    uint64_t* o = out.mutable_data();
    bl::list_positives(P, 0, P.count, o);
    return out;
}

// Runs a kernel without the GIL (its deepreduce::Error reaches Python as ValueError).
template <class F>
void run_released(F fn) {
    py::gil_scoped_release release;
    fn();
}

// (family, policy, k, size, seed, draw_seed) of bloom.BloomParams.
py::tuple params_tuple(const bl::Params& p) {
    return py::make_tuple(p.family == bl::Family::BLOCKED ? "blocked" : "splitmix", bl::POLICIES[p.policy], p.k, p.size,
                          p.seed, p.draw_seed);
}

}  // namespace

PYBIND11_MODULE(_bloom, mod) {
    deepreduce::py_args::register_errors();
    mod.doc() = "C++ Bloom filter kernels of deepreduce (hash families documented in docs/bloom.md)";

    mod.def(
        "positions",
        [](py::object x, py::object size, py::object k, py::object seed, const std::string& family) {
            const bl::Family fam = family_arg(family);
            const uint64_t sz = size_arg(size, fam);
            const int kk = k_arg(k);
            const uint64_t s = int_arg(seed, "seed", 0, U64_MAX);
            U64Array idx = index_array(x, "x");
            if (sz == 0)
                throw py::value_error(fam == bl::Family::BLOCKED ? "blocks must be positive" : "m must be positive");
            U64Array out({idx.size(), static_cast<py::ssize_t>(kk)});
            uint64_t* o = out.mutable_data();
            run_released([&] {
                if (fam == bl::Family::BLOCKED)
                    bl::blocked::positions(idx.data(), idx.size(), sz, kk, s, o);
                else
                    bl::splitmix::positions(idx.data(), idx.size(), sz, kk, s, o);
            });
            return out;
        },
        py::arg("x"), py::arg("size"), py::arg("k"), py::arg("seed"), py::arg("family") = "blocked",
        "bit positions of every x (an (n, k) uint64 array); size = blocks (blocked) or m (splitmix)");

    mod.def(
        "build",
        [](py::object indices, py::object blocks, py::object k, py::object seed, py::object threads) {
            const uint64_t nb = int_arg(blocks, "blocks", 0, bl::blocked::MAX_BLOCKS);
            const int kk = k_arg(k);
            const uint64_t s = int_arg(seed, "seed", 0, U64_MAX);
            const int t = threads_arg(threads);
            U64Array idx = index_array(indices, "indices");
            if (nb == 0 && idx.size() > 0) throw py::value_error("blocks must be positive to insert indices");
            std::string bits(nb * bl::blocked::BLOCK_BYTES, '\0');
            uint8_t* b = reinterpret_cast<uint8_t*>(&bits[0]);
            run_released([&] { bl::blocked::build(idx.data(), idx.size(), nb, kk, s, b, t); });
            return py::bytes(bits);
        },
        py::arg("indices"), py::arg("blocks"), py::arg("k"), py::arg("seed"), py::arg("threads") = 1,
        "the blocked filter bytes (64 per block) holding the given indices");

    mod.def(
        "query",
        [](py::bytes data, py::object size, py::object k, py::object seed, py::object d, py::object limit,
           py::object threads, const std::string& family, bool simd) {
            const bl::Family fam = family_arg(family);
            const uint64_t sz = size_arg(size, fam);
            const int kk = k_arg(k);
            const uint64_t s = int_arg(seed, "seed", 0, U64_MAX);
            const uint64_t dd = int_arg(d, "d", 0, U64_MAX);
            const uint64_t lim = int_arg(limit, "limit", 0, U64_MAX);
            const int t = threads_arg(threads);
            const std::string bits = filter_arg(data, fam, sz);
            bl::Positives out;
            const uint8_t* b = reinterpret_cast<const uint8_t*>(bits.data());
            run_released([&] {
                if (fam == bl::Family::BLOCKED)
                    bl::blocked::query(b, sz, kk, s, dd, lim, t, out, simd);
                else
                    bl::splitmix::query(b, sz, kk, s, dd, lim, t, out);
            });
            return to_array(out);
        },
        py::arg("bits"), py::arg("size"), py::arg("k"), py::arg("seed"), py::arg("d"), py::arg("limit"),
        py::arg("threads") = 1, py::arg("family") = "blocked", py::arg("simd") = true,
        "the first min(|P|, limit + 1) positives P in [0, d), ascending; simd=False forces the portable "
        "loop of the blocked family (the same result as its AVX2 code)");

    mod.def(
        "select_random",
        [](py::object positives, py::object r, py::object draw_seed) {
            U64Array P = index_array(positives, "positives");
            const uint64_t rr = int_arg(r, "r", 0, static_cast<uint64_t>(P.size()));
            const uint64_t draw = int_arg(draw_seed, "draw_seed", 0, U64_MAX);
            U64Array out(static_cast<py::ssize_t>(rr));
            uint64_t* o = out.mutable_data();
            run_released([&] { bl::select_random(P.data(), P.size(), rr, draw, o); });
            return out;
        },
        py::arg("positives"), py::arg("r"), py::arg("draw_seed"), "policy P1");

    mod.def(
        "select_conflict",
        [](py::object positives, py::object r, py::object size, py::object k, py::object seed, py::object draw_seed,
           const std::string& family) {
            const bl::Family fam = family_arg(family);
            U64Array P = index_array(positives, "positives");
            const uint64_t rr = int_arg(r, "r", 0, static_cast<uint64_t>(P.size()));
            const uint64_t sz = size_arg(size, fam);
            const int kk = k_arg(k);
            const uint64_t s = int_arg(seed, "seed", 0, U64_MAX);
            const uint64_t draw = int_arg(draw_seed, "draw_seed", 0, U64_MAX);
            U64Array out(static_cast<py::ssize_t>(rr));
            uint64_t* o = out.mutable_data();
            run_released([&] { bl::select_conflict(fam, P.data(), P.size(), rr, sz, kk, s, draw, o); });
            return out;
        },
        py::arg("positives"), py::arg("r"), py::arg("size"), py::arg("k"), py::arg("seed"), py::arg("draw_seed"),
        py::arg("family") = "blocked", "policy P2 (conflict sets, Algorithm 1)");

    mod.def(
        "decode",
        [](py::bytes params, py::bytes section, py::object count, py::object numel, py::object threads) {
            const std::string p = params, sec = section;
            const uint64_t n = int_arg(count, "count", 0, U64_MAX);
            const uint64_t d = int_arg(numel, "numel", 0, U64_MAX);
            const int t = threads_arg(threads);
            std::vector<uint64_t> out;
            run_released([&] {
                out = bl::decode(reinterpret_cast<const uint8_t*>(p.data()), p.size(),
                                 reinterpret_cast<const uint8_t*>(sec.data()), sec.size(), n, d, t);
            });
            return to_array(out);
        },
        py::arg("params"), py::arg("section"), py::arg("count"), py::arg("numel"), py::arg("threads") = 1,
        "BloomIndex.decode: the positions (ascending uint64) of a container's Bloom params and filter section "
        "claiming `count` values of a `numel`-element tensor; ValueError with the ContainerError text");

    mod.def(
        "pack_params",
        [](const std::string& policy, py::object k, py::object blocks, py::object seed, py::object draw_seed) {
            bl::Params p;
            p.policy = bl::policy_code(policy);
            p.k = k_arg(k);
            p.size = int_arg(blocks, "blocks", 0, bl::blocked::MAX_BLOCKS);
            p.seed = int_arg(seed, "seed", 0, U64_MAX);
            p.draw_seed = int_arg(draw_seed, "draw_seed", 0, U64_MAX);
            return py::bytes(bl::pack_params(p));
        },
        py::arg("policy"), py::arg("k"), py::arg("blocks"), py::arg("seed"), py::arg("draw_seed"),
        "the params of a blocked filter (bloom.pack_params)");

    mod.def(
        "unpack_params",
        [](const py::bytes& params) {
            const std::string b = params;
            return params_tuple(bl::unpack_params(reinterpret_cast<const uint8_t*>(b.data()), b.size()));
        },
        py::arg("params"),
        "(family, policy, k, size, seed, draw_seed) of either family; ValueError with the "
        "ContainerError text for bad params");

    mod.def(
        "blocks_for",
        [](py::object r, double keys_per_block) { return bl::blocks_for(int_arg(r, "r", 0, U64_MAX), keys_per_block); },
        py::arg("r"), py::arg("keys_per_block"), "the block count of a filter for r indices (bloom.filter_params)");

    mod.def(
        "positive_limit",
        [](py::bytes data, py::object size, py::object k, py::object r, py::object d, const std::string& family,
           bool conflict) {
            const bl::Family fam = family_arg(family);
            const uint64_t sz = size_arg(size, fam);
            const int kk = k_arg(k);
            const uint64_t rr = int_arg(r, "r", 0, U64_MAX);
            const uint64_t dd = int_arg(d, "d", 0, U64_MAX);
            const std::string bits = filter_arg(data, fam, sz);
            uint64_t limit = 0;
            const uint8_t* b = reinterpret_cast<const uint8_t*>(bits.data());
            run_released([&] { limit = bl::positive_limit(fam, b, sz, kk, rr, dd, conflict); });
            return limit;
        },
        py::arg("bits"), py::arg("size"), py::arg("k"), py::arg("r"), py::arg("d"), py::arg("family") = "blocked",
        py::arg("conflict") = false,
        "the most positives among [0, d) accepted from a filter claiming r keys (bloom.h positive_limit); "
        "conflict=True adds P2's checks (ValueError)");
}
