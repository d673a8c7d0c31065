// The chunk_enum index section: see chunk_enum.h.
#include "chunk_enum.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/error.h"

namespace deepreduce {
namespace chunk_enum {
namespace {

constexpr int64_t MIN_INDICES_PER_THREAD = int64_t{1} << 14;  // less work stays on one thread
constexpr size_t TABLES_KEPT = 3;                             // as chunk_enum.py's _TABLES_KEPT

// width_for of wire/bitpack.py: bits for the integers [0, max_value], at least 1.
int width_for(uint64_t max_value) {
    int width = 0;
    for (; max_value; max_value >>= 1) ++width;
    return std::max(width, 1);
}

// ---------------------------------------------------------------- multi-limb integers
// Unsigned integers of `limbs` 64-bit limbs, the least significant first.

void add_into(uint64_t* acc, const uint64_t* term, int limbs) {
    uint64_t carry = 0;
    for (int k = 0; k < limbs; ++k) {
        const uint64_t partial = acc[k] + carry;
        const uint64_t sum = partial + term[k];
        carry = static_cast<uint64_t>(partial < carry) | static_cast<uint64_t>(sum < partial);
        acc[k] = sum;
    }
}

void subtract_from(uint64_t* acc, const uint64_t* term, int limbs) {  // acc >= term
    uint64_t borrow = 0;
    for (int k = 0; k < limbs; ++k) {
        const uint64_t a = acc[k];
        const uint64_t partial = a - term[k];
        const uint64_t out = partial - borrow;
        borrow = static_cast<uint64_t>(a < term[k]) | static_cast<uint64_t>(partial < borrow);
        acc[k] = out;
    }
}

bool less_equal(const uint64_t* a, const uint64_t* b, int limbs) {
    for (int k = limbs - 1; k >= 0; --k)
        if (a[k] != b[k]) return a[k] < b[k];
    return true;
}

int64_t bit_length(const uint64_t* a, int limbs) {
    for (int k = limbs - 1; k >= 0; --k)
        if (a[k]) return int64_t{64} * k + width_for(a[k]);
    return 0;
}

// ---------------------------------------------------------------- bit stream (LSB first)
// Stream bit p is bit p % 8 of byte p / 8; up to 56 bits move with one 8-byte load (the hosts
// deepreduce builds on are little-endian, as the container format is), byte by byte at the end.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the bit stream is read with little-endian loads");

uint64_t load_word(const uint8_t* data, size_t size, size_t byte) {
    uint64_t word = 0;
    if (byte + 8 <= size) {
        std::memcpy(&word, data + byte, 8);
    } else {
        for (size_t b = byte; b < size; ++b) word |= static_cast<uint64_t>(data[b]) << (8 * (b - byte));
    }
    return word;
}

// ORs the low `n` (<= 64) bits of `value` into the stream of `size` bytes at bit `pos`.
void put_bits(uint8_t* out, size_t size, uint64_t pos, uint64_t value, int n) {
    while (n > 0) {
        const size_t byte = pos >> 3;
        const int shift = static_cast<int>(pos & 7);
        const int take = std::min(n, 56);
        const uint64_t piece = (value & ((uint64_t{1} << take) - 1)) << shift;
        if (byte + 8 <= size) {
            uint64_t word;
            std::memcpy(&word, out + byte, 8);
            word |= piece;
            std::memcpy(out + byte, &word, 8);
        } else {
            for (size_t b = byte; b < size; ++b) out[b] |= static_cast<uint8_t>(piece >> (8 * (b - byte)));
        }
        value >>= take;
        pos += take;
        n -= take;
    }
}

// The `n` (<= 64) bits of the stream of `size` bytes at bit `pos`.
uint64_t get_bits(const uint8_t* in, size_t size, uint64_t pos, int n) {
    uint64_t value = 0;
    for (int got = 0; got < n;) {
        const int take = std::min(n - got, 56);
        const uint64_t word = load_word(in, size, pos >> 3) >> (pos & 7);
        value |= (word & ((uint64_t{1} << take) - 1)) << got;
        got += take;
        pos += take;
    }
    return value;
}

// ---------------------------------------------------------------- binomial tables

// 2^(64 k) for the limbs a double can weigh (k <= 15; the guesses are only kept below 2^1000).
struct LimbWeights {
    double of[16];
    LimbWeights() {
        of[0] = 1.0;
        for (int k = 1; k < 16; ++k) of[k] = of[k - 1] * 18446744073709551616.0;
    }
};
const LimbWeights limb_weights;

// The value of a multi-limb integer whose highest non-zero limb is below `used` (at most 16), as
// a double (from its two highest limbs: a guess for the greedy decode, settled with the exact
// limbs).
double approximate(const uint64_t* a, int used) {
    if (used == 0) return 0.0;
    double value = static_cast<double>(a[used - 1]) * limb_weights.of[used - 1];
    if (used > 1) value += static_cast<double>(a[used - 2]) * limb_weights.of[used - 2];
    return value;
}

int used_limbs(const uint64_t* a, int limbs) {
    while (limbs > 0 && a[limbs - 1] == 0) --limbs;
    return limbs;
}

struct Table {
    int64_t length = 0, rows = 0;
    int limbs = 0;
    std::vector<uint64_t> words;  // C(c, i) at ((i * length) + c) * limbs
    std::vector<double> guesses;  // C(c, i) as doubles at (i * length) + c; empty past a double's range
    size_t slot(int64_t i, int64_t c) const {
        return static_cast<size_t>(i) * static_cast<size_t>(length) + static_cast<size_t>(c);
    }
    const uint64_t* at(int64_t i, int64_t c) const { return words.data() + slot(i, c) * limbs; }
};

double log2_binomial(int64_t length, int64_t rows) {
    return std::max(
        0.0, (std::lgamma(length + 1.0) - std::lgamma(rows + 1.0) - std::lgamma(length - rows + 1.0)) / std::log(2.0));
}

// Limbs that hold C(length, rows) (rows <= length / 2: every entry and every rank is below it),
// from log-gamma with a limb to spare.
int limbs_for(int64_t length, int64_t rows) {
    return static_cast<int>(log2_binomial(length, rows) / 64.0) + 2;
}

std::shared_ptr<const Table> build_table(int64_t length, int64_t rows) {
    auto table = std::make_shared<Table>();
    table->length = length;
    table->rows = rows;
    table->limbs = limbs_for(length, rows);
    const int w = table->limbs;
    table->words.assign(static_cast<size_t>(rows + 1) * static_cast<size_t>(length) * w, 0);
    uint64_t* words = table->words.data();
    for (int64_t c = 0; c < length; ++c) words[static_cast<size_t>(c) * w] = 1;  // C(c, 0)
    for (int64_t i = 1; i <= rows; ++i) {  // C(c, i) = C(c - 1, i) + C(c - 1, i - 1), C(0, i) = 0
        uint64_t* row = words + static_cast<size_t>(i) * length * w;
        const uint64_t* above = row - static_cast<size_t>(length) * w;
        for (int64_t c = 1; c < length; ++c) {
            std::copy(row + (c - 1) * w, row + c * w, row + c * w);
            add_into(row + c * w, above + (c - 1) * w, w);
        }
    }
    if (log2_binomial(length, rows) < 1000.0) {  // every entry within a double's range
        table->guesses.resize(static_cast<size_t>(rows + 1) * static_cast<size_t>(length));
        for (size_t e = 0; e < table->guesses.size(); ++e) {
            const uint64_t* entry = words + e * w;
            table->guesses[e] = approximate(entry, used_limbs(entry, w));
        }
    }
    return table;
}

std::mutex tables_mutex;
std::vector<std::shared_ptr<const Table>> tables;  // the oldest first

// A table holding C(c, i) for c < length, i <= rows: a kept one that covers it, else a new one.
std::shared_ptr<const Table> table_for(int64_t length, int64_t rows) {
    std::lock_guard<std::mutex> lock(tables_mutex);
    for (const auto& table : tables)
        if (table->length >= length && table->rows >= rows) return table;
    if (tables.size() >= TABLES_KEPT) tables.erase(tables.begin());
    tables.push_back(build_table(length, rows));
    return tables.back();
}

// ---------------------------------------------------------------- chunk kinds

// What a chunk of (length, count) is written as; for ENUM its table and C(length, count).
struct Kind {
    Layout layout{};
    int64_t length = 0, count = 0;
    std::shared_ptr<const Table> table;
    std::vector<uint64_t> bound;
};

Kind make_kind(int64_t length, int64_t count, int64_t table_entries) {
    if (length < 1 || count < 0 || count > length)
        fail(ErrorKind::ARGUMENT, "chunk_enum: a chunk of " + std::to_string(length) + " elements cannot hold " +
                                      std::to_string(count) + " indices");
    Kind kind;
    kind.length = length;
    kind.count = count;
    const int64_t ranked = std::min(count, length - count);
    if (ranked <= table_entries / length) {  // ranked * length <= table_entries, without overflow
        kind.table = table_for(length, ranked);
        const int w = kind.table->limbs;
        kind.bound.assign(w, 0);
        if (ranked == 0) {
            kind.bound[0] = 1;
        } else {  // C(length, r) = C(length - 1, r) + C(length - 1, r - 1)
            std::copy(kind.table->at(ranked, length - 1), kind.table->at(ranked, length - 1) + w, kind.bound.begin());
            add_into(kind.bound.data(), kind.table->at(ranked - 1, length - 1), w);
        }
        std::vector<uint64_t> top = kind.bound;  // C(length, count) - 1: the largest rank
        for (int k = 0; k < w; ++k) {
            const bool borrow = top[k] == 0;
            --top[k];
            if (!borrow) break;
        }
        kind.layout = {Mode::ENUM, bit_length(top.data(), w), ranked};
        return kind;
    }
    const int64_t bitmap = length, fixed = count * width_for(static_cast<uint64_t>(length - 1));
    kind.layout = bitmap <= fixed ? Layout{Mode::BITMAP, bitmap, ranked} : Layout{Mode::FIXED, fixed, ranked};
    return kind;
}

// The kinds of one call's chunks, made before any thread starts and then only read.
class Kinds {
  public:
    explicit Kinds(int64_t table_entries) : table_entries_(table_entries) {}
    const Kind& of(int64_t length, int64_t count) {
        auto key = std::make_pair(length, count);
        auto found = kinds_.find(key);
        if (found == kinds_.end()) found = kinds_.emplace(key, make_kind(length, count, table_entries_)).first;
        return found->second;
    }
    const Kind& find(int64_t length, int64_t count) const { return kinds_.at(std::make_pair(length, count)); }

  private:
    int64_t table_entries_;
    std::map<std::pair<int64_t, int64_t>, Kind> kinds_;
};

// The ascending offsets of [0, length) that are not among the m ascending ones of `a`.
void complement(const int64_t* a, int64_t m, int64_t length, int64_t* out) {
    int64_t t = 0, w = 0;
    for (int64_t v = 0; v < length; ++v) {
        if (t < m && a[t] == v) {
            ++t;
            continue;
        }
        out[w++] = v;
    }
}

void write_chunk(const Kind& kind, const int64_t* offsets, uint64_t pos, uint8_t* out, size_t size,
                 std::vector<int64_t>& spare, std::vector<uint64_t>& rank) {
    const Layout& lay = kind.layout;
    if (lay.bits == 0) return;
    if (lay.mode == Mode::BITMAP) {
        for (int64_t t = 0; t < kind.count; ++t) put_bits(out, size, pos + offsets[t], 1, 1);
        return;
    }
    if (lay.mode == Mode::FIXED) {
        const int width = width_for(static_cast<uint64_t>(kind.length - 1));
        for (int64_t t = 0; t < kind.count; ++t)
            put_bits(out, size, pos + static_cast<uint64_t>(t) * width, offsets[t], width);
        return;
    }
    const Table& table = *kind.table;
    const int w = table.limbs;
    if (lay.ranked != kind.count) {
        spare.resize(lay.ranked);
        complement(offsets, kind.count, kind.length, spare.data());
        offsets = spare.data();
    }
    rank.assign(w, 0);
    for (int64_t i = 1; i <= lay.ranked; ++i) add_into(rank.data(), table.at(i, offsets[i - 1]), w);
    for (int64_t written = 0, k = 0; written < lay.bits; written += 64, ++k)
        put_bits(out, size, pos + written, rank[k], static_cast<int>(std::min<int64_t>(64, lay.bits - written)));
}

// The largest c in [lo, up] with C(c, i) <= rank (C(lo, i) <= rank holds): a binary search over
// the doubles where the table has them, settled with the exact limbs, else over the limbs.
int64_t largest_below(const Table& table, int64_t i, int64_t lo, int64_t up, const uint64_t* rank, int used) {
    const int w = table.limbs;
    if (!table.guesses.empty()) {
        const double* row = table.guesses.data() + table.slot(i, 0);
        const double target = approximate(rank, used);
        // A first guess (the largest of i offsets spread evenly below the previous one), then a
        // bracket galloping from it, then a binary search inside: a few reads of the row.
        int64_t a = std::max(lo, (up + 1) * i / (i + 1));
        int64_t b;  // row[a] <= target < row[b] (b = up + 1: past the end)
        if (row[a] <= target) {
            int64_t step = 1;
            b = a + 1;
            while (b <= up && row[b] <= target) {
                a = b;
                b = std::min(up + 1, b + step);
                step *= 2;
            }
        } else {
            int64_t step = 1;
            b = a;
            a = std::max(lo, b - step);
            while (a > lo && row[a] > target) {
                b = a;
                step *= 2;
                a = std::max(lo, a - step);
            }
        }
        while (b - a > 1) {
            const int64_t mid = a + (b - a) / 2;
            if (row[mid] <= target)
                a = mid;
            else
                b = mid;
        }
        // Both doubles are within 2^-52 of their integers: a gap wider than 2^-45 of the rank
        // decides a comparison; only closer ones read the limbs.
        const double margin = target * 0x1p-45;
        while (a < up && row[a + 1] <= target + margin && less_equal(table.at(i, a + 1), rank, w)) ++a;
        while (a > lo && row[a] >= target - margin && !less_equal(table.at(i, a), rank, w)) --a;
        return a;
    }
    while (lo < up) {
        const int64_t mid = lo + (up - lo + 1) / 2;
        if (less_equal(table.at(i, mid), rank, w))
            lo = mid;
        else
            up = mid - 1;
    }
    return lo;
}

// Reads one chunk at bit `pos` into out (kind.count offsets); false with `failure` set when the
// chunk is one no encoder writes.
bool read_chunk(const Kind& kind, const uint8_t* in, size_t size, uint64_t pos, int64_t* out,
                std::vector<int64_t>& spare, std::vector<uint64_t>& rank, std::string& failure) {
    const Layout& lay = kind.layout;
    if (lay.mode == Mode::BITMAP) {
        int64_t held = 0;
        for (int64_t v = 0; v < kind.length; ++v) {
            const uint64_t at = pos + static_cast<uint64_t>(v);
            if ((in[at >> 3] >> (at & 7)) & 1) {
                if (held < kind.count) out[held] = v;
                ++held;
            }
        }
        if (held != kind.count) {
            failure =
                "chunk_enum bitmap holds " + std::to_string(held) + " indices, expected " + std::to_string(kind.count);
            return false;
        }
        return true;
    }
    if (lay.mode == Mode::FIXED) {
        const int width = width_for(static_cast<uint64_t>(kind.length - 1));
        for (int64_t t = 0; t < kind.count; ++t)
            out[t] = static_cast<int64_t>(get_bits(in, size, pos + static_cast<uint64_t>(t) * width, width));
        return true;
    }
    const Table& table = *kind.table;
    const int w = table.limbs;
    rank.assign(w, 0);
    for (int64_t read = 0, k = 0; read < lay.bits; read += 64, ++k)
        rank[k] = get_bits(in, size, pos + read, static_cast<int>(std::min<int64_t>(64, lay.bits - read)));
    if (less_equal(kind.bound.data(), rank.data(), w)) {
        failure = "chunk_enum rank of a chunk exceeds C(" + std::to_string(kind.length) + ", " +
                  std::to_string(kind.count) + ")";
        return false;
    }
    const bool complemented = lay.ranked != kind.count;
    int64_t* offsets = out;
    if (complemented) {
        spare.resize(lay.ranked);
        offsets = spare.data();
    }
    int used = used_limbs(rank.data(), w);
    int64_t hi = kind.length;                    // the next offset is below this one
    for (int64_t i = lay.ranked; i >= 1; --i) {  // greedy: C(i - 1, i) = 0 <= rank
        const int64_t c = largest_below(table, i, i - 1, hi - 1, rank.data(), used);
        subtract_from(rank.data(), table.at(i, c), used);  // C(c, i) <= rank: no limb above `used`
        used = used_limbs(rank.data(), used);
        offsets[i - 1] = c;
        hi = c;
    }
    if (complemented) complement(offsets, lay.ranked, kind.length, out);
    return true;
}

struct Failure {
    int64_t chunk = -1;
    std::string message;
};

// Where a thread's share of the chunks starts.
struct Start {
    int64_t chunk, index;
    uint64_t bit;
};

// The chunks split into up to `threads` runs of about equal index counts (none of fewer than
// MIN_INDICES_PER_THREAD), as their starts followed by the end {chunks, indices, total}.
std::vector<Start> split(const Kinds& kinds, const int64_t* counts, const int64_t* lengths, int64_t chunks,
                         int64_t indices, int64_t total, int threads) {
    const int64_t useful = std::max<int64_t>(1, indices / MIN_INDICES_PER_THREAD);
    const int parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, useful)));
    std::vector<Start> starts{{0, 0, 0}};
    int64_t index = 0;
    uint64_t bit = 0;
    for (int64_t j = 0; j < chunks && static_cast<int>(starts.size()) < parts; ++j) {
        if (index >= static_cast<int64_t>(static_cast<__int128>(indices) * starts.size() / parts)) {
            if (j > starts.back().chunk) starts.push_back({j, index, bit});
        }
        index += counts[j];
        bit += kinds.find(lengths[j], counts[j]).layout.bits;
    }
    starts.push_back({chunks, indices, static_cast<uint64_t>(total)});
    return starts;
}

// Runs work(part) for every part in [0, parts), part 0 on the calling thread.
template <class Work>
void run_parts(size_t parts, Work work) {
    std::vector<std::thread> pool;
    for (size_t part = 1; part < parts; ++part) pool.emplace_back(work, part);
    work(0);
    for (auto& thread : pool) thread.join();
}

}  // namespace

Layout layout(int64_t length, int64_t count, int64_t table_entries) {
    return make_kind(length, count, table_entries).layout;
}

std::vector<uint8_t> pack(const int64_t* local, const int64_t* counts, const int64_t* lengths, int64_t chunks,
                          int64_t table_entries, int threads) {
    check_threads(threads);
    Kinds kinds(table_entries);
    int64_t total = 0, indices = 0;
    for (int64_t j = 0; j < chunks; indices += counts[j], ++j) {
        const Kind& kind = kinds.of(lengths[j], counts[j]);
        total += kind.layout.bits;
        for (int64_t t = 0; t < counts[j]; ++t) {  // the tables are read at these offsets
            const int64_t v = local[indices + t];
            if (v < 0 || v >= lengths[j] || (t > 0 && v <= local[indices + t - 1]))
                fail(ErrorKind::ARGUMENT, "chunk_enum: the offsets of chunk " + std::to_string(j) +
                                              " are not ascending within [0, " + std::to_string(lengths[j]) + ")");
        }
    }
    const size_t size = static_cast<size_t>((total + 7) / 8);
    std::vector<uint8_t> section(size, 0);
    uint8_t* out = section.data();
    const std::vector<Start> starts = split(kinds, counts, lengths, chunks, indices, total, threads);
    // With several parts, each writes its bits into bytes of its own (its first and last byte may
    // hold a neighbour's bits too), ORed into the section afterwards.
    std::vector<std::vector<uint8_t>> own(starts.size() - 1);
    run_parts(own.size(), [&](size_t part) {
        uint8_t* to = out;
        size_t to_size = size;
        uint64_t pos = starts[part].bit;
        if (own.size() > 1) {
            const uint64_t first = starts[part].bit >> 3;
            own[part].assign(static_cast<size_t>(((starts[part + 1].bit + 7) >> 3) - first), 0);
            to = own[part].data();
            to_size = own[part].size();
            pos -= first * 8;
        }
        std::vector<int64_t> spare;
        std::vector<uint64_t> rank;
        const Kind* kind = nullptr;
        const int64_t* offsets = local + starts[part].index;
        for (int64_t j = starts[part].chunk; j < starts[part + 1].chunk; ++j) {
            if (!kind || kind->length != lengths[j] || kind->count != counts[j])
                kind = &kinds.find(lengths[j], counts[j]);
            write_chunk(*kind, offsets, pos, to, to_size, spare, rank);
            pos += kind->layout.bits;
            offsets += counts[j];
        }
    });
    if (own.size() > 1)
        for (size_t part = 0; part < own.size(); ++part) {
            uint8_t* to = out + (starts[part].bit >> 3);
            for (size_t b = 0; b < own[part].size(); ++b) to[b] |= own[part][b];
        }
    return section;
}

void unpack(const uint8_t* section, size_t size, const int64_t* counts, const int64_t* lengths, int64_t chunks,
            int64_t table_entries, int threads, int64_t* out) {
    check_threads(threads);
    Kinds kinds(table_entries);
    int64_t total = 0, indices = 0;
    for (int64_t j = 0; j < chunks; ++j) {
        total += kinds.of(lengths[j], counts[j]).layout.bits;
        indices += counts[j];
    }
    const uint64_t expected = (static_cast<uint64_t>(total) + 7) / 8;
    if (size != expected)
        fail(ErrorKind::CONTAINER, "chunk_enum section has " + std::to_string(size) + " bytes, expected " +
                                       std::to_string(expected) + " for " + std::to_string(indices) + " indices in " +
                                       std::to_string(chunks) + " chunks");
    if ((total & 7) && (section[size - 1] >> (total & 7)))
        fail(ErrorKind::CONTAINER, "chunk_enum section has non-zero padding");

    const std::vector<Start> starts = split(kinds, counts, lengths, chunks, indices, total, threads);
    std::vector<Failure> failures(starts.size() - 1);
    auto work = [&](size_t part) {
        std::vector<int64_t> spare;
        std::vector<uint64_t> rank;
        const Kind* kind = nullptr;
        uint64_t bit = starts[part].bit;
        int64_t* to = out + starts[part].index;
        for (int64_t j = starts[part].chunk; j < starts[part + 1].chunk; ++j) {
            if (!kind || kind->length != lengths[j] || kind->count != counts[j])
                kind = &kinds.find(lengths[j], counts[j]);
            if (!read_chunk(*kind, section, size, bit, to, spare, rank, failures[part].message)) {
                failures[part].chunk = j;
                return;
            }
            bit += kind->layout.bits;
            to += counts[j];
        }
    };
    run_parts(failures.size(), work);
    for (const Failure& failure : failures)  // parts in chunk order: the first failure is the stream's first
        if (failure.chunk >= 0) fail(ErrorKind::CONTAINER, failure.message);
}

}  // namespace chunk_enum
}  // namespace deepreduce
