// SIDCo kernels (see sidco.h).
#include "sidco.h"

#include <cmath>
#include <string>

#include "common/error.h"

namespace deepreduce {
namespace sidco {

namespace {

constexpr int LANES = 8;  // independent accumulators: lets the compiler vectorise the sums

[[noreturn]] void capacity_error(const char* what, int64_t cap) {
    fail(ErrorKind::ARGUMENT,
         std::string("sidco ") + what + ": output capacity " + std::to_string(cap) + " is not above the entry count");
}

}  // namespace

void abs_stats(const float* x, int64_t n, bool want_log, double* out) {
    // All-double lanes (the non-zero count too) keep the loop uniform so it vectorises.
    double sum[LANES] = {0}, nz[LANES] = {0}, logs[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        for (int l = 0; l < LANES; ++l) {
            double a = std::fabs(static_cast<double>(x[i + l]));
            sum[l] += a;
            nz[l] += (a != 0.0) ? 1.0 : 0.0;
        }
    }
    for (; i < n; ++i) {
        double a = std::fabs(static_cast<double>(x[i]));
        sum[0] += a;
        nz[0] += (a != 0.0) ? 1.0 : 0.0;
    }
    if (want_log) {
        for (int64_t j = 0; j < n; ++j) {
            float a = std::fabs(x[j]);
            if (a != 0.0f) logs[j % LANES] += std::log(static_cast<double>(a));
        }
    }
    double s = 0, lg = 0, count = 0;
    for (int l = 0; l < LANES; ++l) {
        s += sum[l];
        lg += logs[l];
        count += nz[l];
    }
    out[0] = count;  // exact: counts stay far below 2^53
    out[1] = s;
    out[2] = lg;
}

double abs_sq_dev(const float* x, int64_t n, double mean) {
    double acc[LANES] = {0};
    for (int64_t j = 0; j < n; ++j) {
        float a = std::fabs(x[j]);
        double dev = static_cast<double>(a) - mean;
        acc[j % LANES] += (a != 0.0f) ? dev * dev : 0.0;
    }
    double s = 0;
    for (int l = 0; l < LANES; ++l) s += acc[l];
    return s;
}

int64_t abs_count(const float* x, int64_t n, float eta, bool strict) {
    int64_t count = 0;
    if (strict) {
        for (int64_t j = 0; j < n; ++j) count += (std::fabs(x[j]) > eta);
    } else {
        for (int64_t j = 0; j < n; ++j) count += (std::fabs(x[j]) >= eta);
    }
    return count;
}

// Branch-free compaction: every entry is written at the current end and the end advances only
// when the entry qualifies (random 10-25% selections would mispredict a branch constantly).
// The write position is clamped to the last slot, so a wrong capacity can never write out of
// bounds; it is reported instead.
int64_t abs_exceed(const float* x, int64_t n, float eta, float* out, int64_t cap) {
    if (cap < 1) capacity_error("abs_exceed", cap);
    const int64_t last = cap - 1;
    int64_t k = 0;
    for (int64_t j = 0; j < n; ++j) {
        float a = std::fabs(x[j]);
        out[k < last ? k : last] = a;
        k += (a > eta);
    }
    if (k > last) capacity_error("abs_exceed", cap);
    return k;
}

int64_t abs_select(const float* x, int64_t n, float eta, int64_t* out, int64_t cap) {
    if (cap < 1) capacity_error("abs_select", cap);
    const int64_t last = cap - 1;
    int64_t k = 0;
    for (int64_t j = 0; j < n; ++j) {
        out[k < last ? k : last] = j;
        k += (std::fabs(x[j]) >= eta);
    }
    if (k > last) capacity_error("abs_select", cap);
    return k;
}

}  // namespace sidco
}  // namespace deepreduce
