// Fit-Poly kernel (see fit.h). The NumPy path in deepreduce/values/polyfit.py performs the same
// floating-point operations in the same order, so both produce identical bytes: sequential
// sums, the same Legendre recurrence, the same Cholesky. Contraction into fused multiply-add
// would change the rounding, so it is switched off for this file.
#pragma GCC optimize("fp-contract=off")

#include "fit.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common/error.h"
#include "common/multiversion.h"

namespace deepreduce {
namespace fit {
namespace {

// Automatic segment count per sign: AUTO_SEGMENTS_MIN, plus one per doubling of n beyond
// AUTO_SEGMENTS_BASE values, at most n / AUTO_VALUES_PER_SEGMENT (at least 1): see
// auto_segments.
constexpr int AUTO_SEGMENTS_MIN = 4;
constexpr int64_t AUTO_SEGMENTS_BASE = 1000;
constexpr int64_t AUTO_VALUES_PER_SEGMENT = 64;

inline uint32_t desc_key(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    // Ascending-order key of IEEE floats, then inverted for descending order.
    uint32_t asc = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ~asc;
}

struct Segment {
    int64_t a, b;   // [a, b) in sorted order
    double best;    // largest squared distance to the chord (or -1 if not splittable)
    int64_t split;  // where to split
};

// Squared distance of each interior point to the chord through the end points. The split
// point is the first argmax, moved inside [a + min_points, b - min_points] so both children
// keep min_points points (a steep head whose argmax sits next to an end still splits); a
// segment shorter than 2 min_points, or exactly a line (distance 0), is final (best = -1).
void chord_split(const double* y, Segment& s, int64_t min_points) {
    s.best = -1.0;
    s.split = -1;
    int64_t a = s.a, b = s.b;
    if (b - a < 3 || b - a < 2 * min_points) return;
    double ya = y[a];
    double slope = (y[b - 1] - ya) / static_cast<double>(b - 1 - a);
    double best = -1.0;
    int64_t arg = -1;
    for (int64_t i = a + 1; i < b - 1; ++i) {
        double d = ya + slope * static_cast<double>(i - a) - y[i];
        d = d * d;
        if (d > best) {
            best = d;
            arg = i;
        }
    }
    if (best > 0.0) {
        s.best = best;
        s.split = arg < a + min_points ? a + min_points : (arg > b - min_points ? b - min_points : arg);
    }
}

void segment_part(const double* y, int64_t a, int64_t b, int max_segments, int64_t min_points,
                  std::vector<int64_t>& lengths) {
    if (b <= a) return;
    std::vector<Segment> segs;
    segs.push_back({a, b, -1.0, -1});
    chord_split(y, segs[0], min_points);
    while (static_cast<int>(segs.size()) < max_segments) {
        int pick = -1;
        double best = -1.0;
        for (size_t k = 0; k < segs.size(); ++k) {
            if (segs[k].split >= 0 && segs[k].best > best) {
                best = segs[k].best;
                pick = static_cast<int>(k);
            }
        }
        if (pick < 0) break;
        Segment left{segs[pick].a, segs[pick].split, -1.0, -1};
        Segment right{segs[pick].split, segs[pick].b, -1.0, -1};
        chord_split(y, left, min_points);
        chord_split(y, right, min_points);
        segs[pick] = left;
        segs.insert(segs.begin() + pick + 1, right);
    }
    for (const Segment& s : segs) lengths.push_back(s.b - s.a);
}

// Abscissa step of a segment: t_i = i * h - 1 with h = 2 / (len - 1) (t = 0 when len = 1).
inline double abscissa_step(int64_t len) {
    return len > 1 ? 2.0 / static_cast<double>(len - 1) : 0.0;
}

inline double abscissa(int64_t i, double h, int64_t len) {
    return len > 1 ? static_cast<double>(i) * h - 1.0 : 0.0;
}

// Recurrence constants A_k = (2k+1)/(k+1), B_k = k/(k+1), each rounded once to double.
struct Recurrence {
    double a[MAX_DEGREE + 1], b[MAX_DEGREE + 1];
    Recurrence() {
        for (int k = 0; k <= MAX_DEGREE; ++k) {
            a[k] = (2.0 * k + 1.0) / (k + 1.0);
            b[k] = static_cast<double>(k) / (k + 1.0);
        }
    }
};
const Recurrence REC;

// Legendre P_0..P_deg at t: P_{k+1} = A_k t P_k - B_k P_{k-1}.
inline void legendre(double t, int deg, double* p) {
    p[0] = 1.0;
    if (deg >= 1) p[1] = t;
    for (int k = 1; k < deg; ++k) p[k + 1] = REC.a[k] * t * p[k] - REC.b[k] * p[k - 1];
}

// The curve of one segment at its len abscissae, as float32, in out: sum_j coef[j] P_j(t_i),
// the recurrence and the sum in the same order as legendre() and a loop over j. The degree is a
// template parameter so that the loop over the points vectorises (each point on its own: the
// same operations in the same order per point, whatever the vector width).
template <int D>
inline void evaluate_points(const double* coef, int64_t len, float* out) {
    const double h = abscissa_step(len);
    for (int64_t i = 0; i < len; ++i) {
        const double t = abscissa(i, h, len);
        double p[D + 1];
        p[0] = 1.0;
        if (D >= 1) p[1] = t;
        for (int k = 1; k < D; ++k) p[k + 1] = REC.a[k] * t * p[k] - REC.b[k] * p[k - 1];
        double acc = coef[0] * p[0];
        for (int j = 1; j <= D; ++j) acc += coef[j] * p[j];
        out[i] = static_cast<float>(acc);
    }
}

template <int... Ds>
inline void evaluate_dispatch(std::integer_sequence<int, Ds...>, const double* coef, int deg, int64_t len, float* out) {
    ((deg == Ds ? evaluate_points<Ds>(coef, len, out) : void()), ...);
}

// evaluate_points for a degree known at run time; false when a value is not finite (float32).
// Compiled for AVX2 too (no FMA: both clones give the same bits).
DR_MULTIVERSION
bool evaluate_segment(const double* coef, int deg, int64_t len, float* out) {
    evaluate_dispatch(std::make_integer_sequence<int, MAX_DEGREE + 1>(), coef, deg, len, out);
    uint32_t bad = 0;
    for (int64_t i = 0; i < len; ++i) {
        uint32_t bits;
        std::memcpy(&bits, out + i, 4);
        bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
    }
    return bad == 0;
}

// Accumulates the lower triangle of the Gram matrix and the right-hand side for M = deg + 1
// basis functions. M is a template parameter so the compiler unrolls the loops; the
// floating-point operations and their order are the same for every M (sequential sums).
template <int M>
void accumulate(const double* y, int64_t len, double (*G)[MAX_DEGREE + 1], double* r) {
    double p[MAX_DEGREE + 1];
    const double h = abscissa_step(len);
    for (int64_t i = 0; i < len; ++i) {
        legendre(abscissa(i, h, len), M - 1, p);
        for (int j = 0; j < M; ++j) {
            for (int k = 0; k <= j; ++k) G[j][k] += p[j] * p[k];
            r[j] += p[j] * y[i];
        }
    }
}

template <int... Ms>
void accumulate_dispatch(int m, const double* y, int64_t len, double (*G)[MAX_DEGREE + 1], double* r,
                         std::integer_sequence<int, Ms...>) {
    ((m == Ms + 1 ? (accumulate<Ms + 1>(y, len, G, r), true) : false) || ...);
}

// Least squares of y[0..len) in the Legendre basis of degree deg via normal equations
// (well conditioned on [-1, 1]) and Cholesky, all in double.
void fit_segment(const double* y, int64_t len, int deg, double* coef) {
    const int m = deg + 1;
    double G[MAX_DEGREE + 1][MAX_DEGREE + 1] = {};
    double r[MAX_DEGREE + 1] = {};
    accumulate_dispatch(m, y, len, G, r, std::make_integer_sequence<int, MAX_DEGREE + 1>{});
    double L[MAX_DEGREE + 1][MAX_DEGREE + 1] = {};
    for (int j = 0; j < m; ++j) {
        double s = G[j][j];
        for (int q = 0; q < j; ++q) s -= L[j][q] * L[j][q];
        if (!(s > 0.0)) fail(ErrorKind::ENCODE, "polyfit normal equations are not positive definite");
        L[j][j] = std::sqrt(s);
        for (int i = j + 1; i < m; ++i) {
            double t = G[i][j];
            for (int q = 0; q < j; ++q) t -= L[i][q] * L[j][q];
            L[i][j] = t / L[j][j];
        }
    }
    double z[MAX_DEGREE + 1];
    for (int j = 0; j < m; ++j) {
        double s = r[j];
        for (int q = 0; q < j; ++q) s -= L[j][q] * z[q];
        z[j] = s / L[j][j];
    }
    for (int j = m - 1; j >= 0; --j) {
        double s = z[j];
        for (int q = j + 1; q < m; ++q) s -= L[q][j] * coef[q];
        coef[j] = s / L[j][j];
    }
    for (int j = 0; j < m; ++j)
        if (!std::isfinite(coef[j])) fail(ErrorKind::ENCODE, "polyfit coefficient is not finite");
}

inline void put_u32(uint8_t* out, uint32_t v) {
    for (int i = 0; i < 4; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
}

inline uint32_t get_u32(const uint8_t* in) {
    return static_cast<uint32_t>(in[0]) | (static_cast<uint32_t>(in[1]) << 8) | (static_cast<uint32_t>(in[2]) << 16) |
           (static_cast<uint32_t>(in[3]) << 24);
}

inline int seg_degree(int64_t len, int degree) {
    return static_cast<int>(len - 1 < degree ? len - 1 : degree);
}

bool valid_args(int degree, int coef_bytes) {
    return degree >= 0 && degree <= MAX_DEGREE && (coef_bytes == 4 || coef_bytes == 8);
}

[[noreturn]] void argument_error() {
    fail(ErrorKind::ARGUMENT,
         "invalid polyfit argument (degree in [0, 15], coefficient width 4 or 8, segments >= 0, n < 2**32)");
}

[[noreturn]] void container_error(const std::string& message) {
    fail(ErrorKind::CONTAINER, message);
}

}  // namespace

std::string pack_params(const Params& p) {
    return std::string{static_cast<char>(p.degree), static_cast<char>(p.coef_bytes)};
}

Params unpack_params(const uint8_t* params, size_t len) {
    if (len != PARAMS_BYTES) container_error("polyfit parameters have " + std::to_string(len) + " bytes, expected 2");
    Params p{params[0], params[1]};
    if (!valid_args(p.degree, p.coef_bytes))
        container_error("polyfit parameters invalid: degree " + std::to_string(p.degree) + ", coefficient bytes " +
                        std::to_string(p.coef_bytes));
    return p;
}

void sort_desc(const float* v, int64_t n, int64_t* perm) {
    if (n < 0) argument_error();
    if (n == 0) return;
    // LSD radix sort on the 32-bit descending key: 11 + 11 + 10 bits, stable.
    std::vector<uint32_t> keys(n), keys2(n);
    std::vector<int64_t> idx2(n);
    for (int64_t i = 0; i < n; ++i) {
        keys[i] = desc_key(v[i]);
        perm[i] = i;
    }
    const int shifts[3] = {0, 11, 22};
    const uint32_t masks[3] = {0x7FF, 0x7FF, 0x3FF};
    uint32_t* ksrc = keys.data();
    uint32_t* kdst = keys2.data();
    int64_t* isrc = perm;
    int64_t* idst = idx2.data();
    for (int pass = 0; pass < 3; ++pass) {
        std::vector<int64_t> count(2049, 0);
        const int sh = shifts[pass];
        const uint32_t mk = masks[pass];
        for (int64_t i = 0; i < n; ++i) ++count[((ksrc[i] >> sh) & mk) + 1];
        for (int b = 0; b < 2048; ++b) count[b + 1] += count[b];
        for (int64_t i = 0; i < n; ++i) {
            int64_t pos = count[(ksrc[i] >> sh) & mk]++;
            kdst[pos] = ksrc[i];
            idst[pos] = isrc[i];
        }
        std::swap(ksrc, kdst);
        std::swap(isrc, idst);
    }
    // After 3 passes the result lives in idx2 (odd number of swaps).
    if (isrc != perm) std::memcpy(perm, isrc, sizeof(int64_t) * n);
}

int auto_segments(int64_t n) {
    int extra = 0;
    while (extra < 40 && (static_cast<int64_t>(AUTO_SEGMENTS_BASE) << extra) < n) ++extra;
    const int64_t by_size = n / AUTO_VALUES_PER_SEGMENT;
    const int64_t count = AUTO_SEGMENTS_MIN + extra;
    return static_cast<int>(count < by_size ? count : (by_size > 1 ? by_size : 1));
}

int64_t payload_bound(int64_t n, int degree, int max_segments, int coef_bytes) {
    if (n < 0 || max_segments < 0 || !valid_args(degree, coef_bytes)) argument_error();
    if (max_segments == 0) max_segments = auto_segments(n);
    int64_t segs = 2 * static_cast<int64_t>(max_segments);
    return 4 + segs * (4 + static_cast<int64_t>(degree + 1) * coef_bytes);
}

int64_t encode(const float* values, int64_t n, int degree, int max_segments, int min_points, int coef_bytes,
               int64_t* perm, uint8_t* out, int64_t out_capacity) {
    if (n < 0 || n > 0xFFFFFFFFLL || max_segments < 0 || min_points < 1 || !valid_args(degree, coef_bytes))
        argument_error();
    if (max_segments == 0) max_segments = auto_segments(n);
    const int64_t bound = payload_bound(n, degree, max_segments, coef_bytes);
    if (out_capacity < bound) fail(ErrorKind::ARGUMENT, "polyfit output buffer too small");
    sort_desc(values, n, perm);
    std::vector<double> y(n);
    int64_t l = 0;
    for (int64_t j = 0; j < n; ++j) {
        y[j] = static_cast<double>(values[perm[j]]);
        if (y[j] >= 0.0) ++l;
    }
    const int64_t minp = min_points > degree + 1 ? min_points : degree + 1;
    std::vector<int64_t> lengths;
    segment_part(y.data(), 0, l, max_segments, minp, lengths);
    segment_part(y.data(), l, n, max_segments, minp, lengths);

    uint8_t* w = out;
    put_u32(w, static_cast<uint32_t>(l));
    w += 4;
    for (int64_t len : lengths) {
        put_u32(w, static_cast<uint32_t>(len));
        w += 4;
    }
    int64_t start = 0;
    double coef[MAX_DEGREE + 1];
    for (int64_t len : lengths) {
        int deg = seg_degree(len, degree);
        fit_segment(y.data() + start, len, deg, coef);
        for (int j = 0; j <= deg; ++j) {
            if (coef_bytes == 4) {
                float f = static_cast<float>(coef[j]);
                if (!std::isfinite(f)) fail(ErrorKind::ENCODE, "polyfit coefficient is not finite");
                std::memcpy(w, &f, 4);  // little-endian hosts only (x86-64, aarch64)
            } else {
                std::memcpy(w, &coef[j], 8);
            }
            w += coef_bytes;
        }
        start += len;
    }
    return static_cast<int64_t>(w - out);
}

namespace {

// The segment table of a payload: its lengths must add up to l and n, and the coefficients
// after it must take exactly the remaining bytes (polyfit.parse_lengths and decode_numpy's length
// check, with their texts). Reads only the payload (never n entries), so a count the payload
// cannot back is refused before anything of n values is allocated.
void parse_table(const uint8_t* payload, int64_t len, int64_t n, int degree, int coef_bytes,
                 std::vector<int64_t>* lengths, int64_t* coef_pos) {
    if (n < 0 || len < 0 || !valid_args(degree, coef_bytes)) argument_error();
    if (len < 4) container_error("polyfit value section has " + std::to_string(len) + " bytes; at least 4 expected");
    const int64_t l = get_u32(payload);
    if (l > n)
        container_error("polyfit value section claims " + std::to_string(l) + " non-negative values of " +
                        std::to_string(n));
    int64_t pos = 4;
    int64_t coef_count = 0;
    for (int part = 0; part < 2; ++part) {
        const int64_t total = part == 0 ? l : n - l;
        int64_t sum = 0;
        while (sum < total) {
            if (pos + 4 > len) container_error("polyfit value section ends inside its segment table");
            int64_t s = get_u32(payload + pos);
            pos += 4;
            if (s == 0 || s > total - sum) container_error("polyfit segment lengths do not add up to the value count");
            sum += s;
            if (lengths) lengths->push_back(s);
            coef_count += seg_degree(s, degree) + 1;
        }
    }
    if (len - pos != coef_count * coef_bytes)
        container_error("polyfit value section has " + std::to_string(len) + " bytes, its segment table implies " +
                        std::to_string(pos + coef_count * coef_bytes));
    if (coef_pos) *coef_pos = pos;
}

}  // namespace

void check_payload(const uint8_t* payload, int64_t len, int64_t n, int degree, int coef_bytes) {
    parse_table(payload, len, n, degree, coef_bytes, nullptr, nullptr);
}

void decode(const uint8_t* payload, int64_t len, int64_t n, int degree, int coef_bytes, float* out) {
    std::vector<int64_t> lengths;
    int64_t pos = 0;
    parse_table(payload, len, n, degree, coef_bytes, &lengths, &pos);
    const uint8_t* c = payload + pos;
    int64_t start = 0;
    double coef[MAX_DEGREE + 1];
    for (int64_t seglen : lengths) {  // every coefficient is checked before any value is computed
        const int deg = seg_degree(seglen, degree);
        for (int j = 0; j <= deg; ++j, c += coef_bytes) {
            if (coef_bytes == 4) {
                float f;
                std::memcpy(&f, c, 4);
                coef[0] = static_cast<double>(f);
            } else {
                std::memcpy(&coef[0], c, 8);
            }
            if (!std::isfinite(coef[0])) container_error("polyfit value section holds a non-finite coefficient");
        }
    }
    c = payload + pos;
    for (int64_t seglen : lengths) {
        const int deg = seg_degree(seglen, degree);
        for (int j = 0; j <= deg; ++j, c += coef_bytes) {
            if (coef_bytes == 4) {
                float f;
                std::memcpy(&f, c, 4);
                coef[j] = static_cast<double>(f);
            } else {
                std::memcpy(&coef[j], c, 8);
            }
        }
        if (!evaluate_segment(coef, deg, seglen, out + start))
            container_error("polyfit value section decodes to non-finite values");
        start += seglen;
    }
}

}  // namespace fit
}  // namespace deepreduce
