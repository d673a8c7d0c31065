"""Bloom filter index codec with every DeepReduce policy (DeepReduce, Kostopoulou et al., §3 and §4).

The sender inserts the sparsifier's support ``S`` into a Bloom filter; both sides query every
position of the tensor; the positives ``P`` (ascending) contain ``S`` plus false positives. A
policy then decides what travels:

* ``naive``: the ``r`` values of ``S`` (ascending); the receiver puts them on the first ``r``
  positives, so one false positive shifts every later value (the paper's baseline).
* ``p0``: every positive, with its value from the dense gradient; lossless on ``S``.
* ``p1``: ``r`` positives drawn uniformly without replacement from a seeded stream.
* ``p2``: ``r`` positives picked from conflict sets, smallest first (Algorithm 1).
* ``leftmost``, ``middle``, ``rightmost``: a deterministic window of ``r`` positives.

Except for ``naive`` the values come from the dense (compensated) gradient.

Two hash families (docs/bloom.md). Encoders write the **blocked** family (container format v2):
a cache-line-blocked filter of 512-bit blocks whose ``k`` probes all come from one 64-bit hash
of the index, sized by :func:`filter_params` so that its false-positive rate stays at ``fpr``.
The **SplitMix64** family (``k`` independent hashes over ``m`` bits) of format v1 is decoded only.
The NumPy path below produces the same bytes and choices as the C++ kernels in ``csrc/bloom``
(tests compare them); the C++ kernels run on ``threads`` threads without changing a byte.

Wire params of the blocked family: ``0x10 | policy`` u8 | k u8 | blocks varint | hash seed varint
| draw seed u64 (``p1``/``p2`` only). Payload: ``64 * blocks`` filter bytes, bit ``j`` at bit
``j % 8`` of byte ``j // 8``. SplitMix64 params (v1, 26 bytes): policy u8 | k u8 | m u64 | hash
seed u64 | draw seed u64; payload ``ceil(m/8)`` bytes. The header's value count is ``|P|`` for
``p0`` and ``r`` otherwise.
"""
from __future__ import annotations

import functools
import math
import struct
import sys
from array import array
from typing import NamedTuple

import numpy as np

from ..backend import _native, arrays
from ..errors import ContainerError, DeepReduceError
from ..params import Param
from ..registry import register
from ..wire import varint
from ..wire.hashing import GAMMA, MASK64, mix64, mix64_int
from ._base import IndexCodec, IndexEncoding, sorted_pairs

POLICIES = ("naive", "p0", "p1", "p2", "leftmost", "middle", "rightmost")
_POLICY_CODE = {name: code for code, name in enumerate(POLICIES)}
DRAWING = ("p1", "p2")
PREFIX = ("naive", "leftmost", "p0")   # the receiver needs only the first `count` positives
MAX_K = 64
#: The lowest ``fpr`` a config may ask for: at 1e-12 a filter expects one false positive in 2**40
#: queried positions (a tensor of 4 TiB of float32); a lower rate buys nothing on any tensor that
#: fits in memory, only more filter bytes.
MIN_FPR = 1e-12
FAMILIES = ("splitmix", "blocked")   # index = the family code in the params' high nibble
BLOCKED = FAMILIES.index("blocked")

_LO32 = 0xFFFFFFFF
_CHUNK = 1 << 20          # positions per query pass on a CPU (cache-sized)
# torch tensors on a CPU (without the extension): below torch's grain size (32768 elements), so
# every operation of a pass stays on the calling thread; beyond it torch splits each of the
# pass's ~40 small operations over its intra-op threads, which on a busy host cost 10 to 100
# times the operation (measured: a shift of 2**16 int64, 0.01 ms on one thread, 8 ms on two)
_CHUNK_TORCH_CPU = 1 << 15
_CHUNK_GPU = 1 << 26      # on a GPU: few passes, so kernel launches do not dominate

BLOCK_BITS = 512
BLOCK_BYTES = BLOCK_BITS // 8
PROBE_MUL = 0x5BD1E995
MAX_BLOCKS = (1 << 31) - 1
_SPLITMIX_PARAMS = struct.Struct("<BBQQQ")
_DRAW = struct.Struct("<Q")


# ---------------------------------------------------------------------------------- hashing
# Written once against an array namespace (deepreduce.backend.arrays, deepreduce.wire.hashing): the same
# functions hash NumPy uint64 arrays and torch int64 "word" tensors on any device, bit for bit.
def blocked_key(seed: int) -> int:
    """The blocked family's key: ``mix64(seed + GAMMA)``."""
    return mix64_int(seed + GAMMA)


def _blocked_hash(x, seed: int):
    """``(h, g_0)`` of words ``x``: ``h = mix64(key + x*GAMMA)``, ``g_0`` its low 32 bits."""
    a = arrays.adapter(x)
    h = mix64(x * a.const(GAMMA) + a.const(blocked_key(seed)))
    return h, h & a.const(_LO32)


def _block_base(h, blocks: int):
    a = arrays.adapter(h)
    return a.shr(a.shr(h, 32) * a.const(blocks), 32) * a.const(BLOCK_BITS)


def _next_probe(g):
    a = arrays.adapter(g)
    return (g * a.const(PROBE_MUL)) & a.const(_LO32)


def blocked_positions(x, blocks: int, k: int, seed: int):
    """Global bit positions ``512*block(x) + (g_i >> 23)`` as an (n, k) array of words (uint64
    for NumPy input; any integer array or tensor is accepted)."""
    a = arrays.adapter(x)
    x = a.words(x)
    h, g = _blocked_hash(x, seed)
    base = _block_base(h, blocks)
    columns = []
    for _ in range(k):
        columns.append(base + a.shr(g, 23))
        g = _next_probe(g)
    return arrays.namespace(x).stack(columns, axis=1)


def mulhi64(a, b: int):
    """floor(a * b / 2**64) for 64-bit words ``a`` and an integer ``0 <= b < 2**64`` (exact)."""
    ad = arrays.adapter(a)
    lo = ad.const(_LO32)
    bh, bl = ad.const(b >> 32), ad.const(b & _LO32)
    ah, al = ad.shr(a, 32), a & lo
    ll, lh, hl, hh = al * bl, al * bh, ah * bl, ah * bh
    mid = ad.shr(ll, 32) + (lh & lo) + (hl & lo)
    return hh + ad.shr(lh, 32) + ad.shr(hl, 32) + ad.shr(mid, 32)


def hash_key(seed: int, i: int) -> int:
    """SplitMix64 family: ``key_i = mix64(seed + (i+1) * GAMMA)``."""
    return mix64_int(seed + (i + 1) * GAMMA)


def splitmix_positions(x, m: int, k: int, seed: int):
    """SplitMix64 family: ``h_i(x) = floor(mix64(key_i + x*GAMMA) * m / 2**64)``, (n, k) words."""
    a = arrays.adapter(x)
    xg = a.words(x) * a.const(GAMMA)
    columns = [mulhi64(mix64(xg + a.const(hash_key(seed, i))), m) for i in range(k)]
    return arrays.namespace(xg).stack(columns, axis=1)


def positions(x, size: int, k: int, seed: int, family: str = "blocked"):
    """Bit positions of every ``x`` in a filter of ``size`` blocks (blocked) or ``size`` bits (splitmix)."""
    return (blocked_positions if family == "blocked" else splitmix_positions)(x, size, k, seed)


# ---------------------------------------------------------------------------------- sizing
def _occupancy_moments(k: int, members: int) -> np.ndarray:
    """``E[(S_b / 512)**k]`` for ``b = k*i`` probes, ``i = 0..members``: the chance that ``k`` uniform
    probes all hit set bits of a block after ``i`` members set ``k`` uniform bits each."""
    dist = np.zeros(BLOCK_BITS + 1)
    dist[0] = 1.0
    frac = np.arange(BLOCK_BITS + 1) / BLOCK_BITS
    hit = frac ** k
    out = np.empty(members + 1)
    out[0] = 0.0
    for i in range(1, members + 1):
        for _ in range(k):   # one more probe: stays on a set bit with probability s/512
            moved = dist * (1.0 - frac)
            dist = dist * frac
            dist[1:] += moved[:-1]
        out[i] = float(dist @ hit)
    return out


def _poisson(lam: float, n: int) -> np.ndarray:
    i = np.arange(n)
    logs = -lam + i * math.log(lam) - np.array([math.lgamma(v + 1) for v in i]) if lam > 0 else None
    return np.exp(logs) if lam > 0 else (i == 0).astype(float)


def _members_bound(lam: float) -> int:
    return int(lam + 9 * math.sqrt(lam) + 12)   # the Poisson tail beyond holds < 1e-15


@functools.lru_cache(maxsize=16)
def _moments(k: int, members: int) -> np.ndarray:
    return _occupancy_moments(k, members)


def blocked_fpr(keys_per_block: float, k: int) -> float:
    """False-positive rate of the blocked filter with ``keys_per_block`` = r / blocks on average:
    ``sum_i Poisson(i; lam) * E[(S_{k i} / 512)**k]`` (members per block ~ Poisson(lam); ``S_b`` the
    set bits after ``b`` uniform probes into 512 bits). The Poisson spread is a little wider than
    the binomial one, so the formula errs on the high side."""
    lam = float(keys_per_block)
    n = _members_bound(lam)
    bound = max(16, 1 << (n - 1).bit_length())   # cache one moment table per power of two
    return float(_poisson(lam, n) @ _moments(k, bound)[:n])


def _max_keys_per_block(fpr: float, k: int) -> float:
    """The largest lam with blocked_fpr(lam, k) <= fpr (bisection; the rate grows with lam)."""
    lo, hi = 0.0, BLOCK_BITS * math.log(2) / k   # an unblocked filter's optimum; blocking only lowers it
    while blocked_fpr(hi, k) <= fpr and hi < 8192:
        lo, hi = hi, 2 * hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if blocked_fpr(mid, k) <= fpr else (lo, mid)
    return lo


@functools.lru_cache(maxsize=64)
def _keys_per_block(fpr: float):
    """(lam, k) for the k that lets the most keys share a block at rate ``fpr``: lam(k) rises to
    one maximum, so walk down and up from the unblocked optimum ``ceil(log2(1/fpr))``."""
    k0 = min(MAX_K, max(1, math.ceil(math.log2(1.0 / fpr))))
    best = (_max_keys_per_block(fpr, k0), k0)
    for step in (-1, 1):
        k = k0 + step
        while 1 <= k <= MAX_K:
            lam = _max_keys_per_block(fpr, k)
            if lam <= best[0]:
                break
            best, k = (lam, k), k + step
    return best


def filter_shape(fpr: float) -> tuple:
    """``(lam, k)`` of :func:`filter_params` for rate ``fpr``: the TensorFlow encode op receives them
    and computes ``blocks = ceil(r / lam)`` itself (the same float64 division)."""
    return _keys_per_block(float(fpr))


@functools.lru_cache(maxsize=1024)   # asked for every tensor of every step, with few distinct r
def filter_params(r: int, fpr: float) -> tuple:
    """``(blocks, k)`` of the blocked filter for ``r`` indices at false-positive rate ``fpr``:
    ``k`` and the keys per block ``lam`` maximise ``lam`` subject to ``blocked_fpr(lam, k) <= fpr``;
    ``blocks = ceil(r / lam)`` (``r = 0``: no blocks)."""
    lam, k = filter_shape(fpr)
    native = _native.load("bloom")
    if native is not None:   # the rule the TensorFlow ops run (csrc/bloom/bloom_wire.cpp blocks_for)
        try:
            return native.blocks_for(r, lam), k
        except ValueError as exc:
            raise DeepReduceError(str(exc)) from None
    if not r:
        return 0, k
    blocks = max(1, math.ceil(r / lam))
    if blocks > MAX_BLOCKS:
        raise DeepReduceError(f"Bloom filter for {r} indices needs {blocks} blocks; at most {MAX_BLOCKS}")
    return blocks, k


def theoretical_fpr(blocks: int, k: int, r: int) -> float:
    """The false-positive rate of a blocked filter of ``blocks`` blocks holding ``r`` indices."""
    return blocked_fpr(r / blocks, k) if blocks else 1.0


# ---------------------------------------------------------------------------------- array path
# Build, query and P1 against the array namespace: NumPy arrays (the path without C++ kernels)
# or torch tensors on their device (the torch device path); the same bytes and choices.
def build(indices, blocks: int, k: int, seed: int):
    """The blocked filter (``64 * blocks`` bytes) holding ``indices``: ``bytes`` for NumPy input,
    a uint8 tensor on the indices' device for torch input."""
    a, xp = arrays.adapter(indices), arrays.namespace(indices)
    bits = xp.zeros(blocks * BLOCK_BITS, dtype=xp.bool, device=indices.device)
    if indices.shape[0]:
        bits[a.index(xp.reshape(blocked_positions(indices, blocks, k, seed), (-1,)))] = True
    return a.packbits(bits)


def np_build(indices: np.ndarray, blocks: int, k: int, seed: int) -> bytes:
    """:func:`build` for NumPy indices (bytes)."""
    return build(np.asarray(indices, dtype=np.uint64), blocks, k, seed)


def query(section, size: int, k: int, seed: int, d: int, limit: int, family: str = "blocked", like=None):
    """The first ``min(|P|, limit + 1)`` positives ``P`` in [0, d), ascending.

    ``section``: the filter as bytes or a uint8 array; the positives are NumPy (``like`` None or
    a NumPy array: uint32 while ``d <= 2**32``, 4 bytes a positive, else uint64) or int64 on
    ``like``'s device for a torch ``like``.
    """
    a = arrays.adapter(like)
    m = size * BLOCK_BITS if family == "blocked" else size
    packed = a.from_section(section, "<u1", like)   # probed in place: 8x less memory than bits
    xp = arrays.namespace(packed)
    if m == 0 or d == 0:
        return xp.zeros(0, dtype=a.word_dtype, device=packed.device)
    keys = [a.const(hash_key(seed, i)) for i in range(k)]

    def survivors(bit_positions):
        """Positions (into the candidates) whose probed bit is set."""
        byte = a.gather(packed, a.index(a.shr(bit_positions, 3)))
        return xp.nonzero((a.words(byte) >> (bit_positions & a.const(7))) & a.const(1))[0]

    found, total = [], 0
    narrow = not arrays.is_torch(packed) and d <= 1 << 32
    chunk = _CHUNK_GPU if str(packed.device).startswith("cuda") else _CHUNK_TORCH_CPU if a.name == "torch" else _CHUNK
    for base in range(0, d, chunk):
        cand = a.words(xp.arange(base, min(d, base + chunk), device=packed.device))
        if family == "blocked":   # each probe tests only the survivors of the previous ones
            h, g = _blocked_hash(cand, seed)
            blk = _block_base(h, size)
            for _ in range(k):
                kept = survivors(blk + a.shr(g, 23))
                cand, blk, g = a.gather(cand, kept), a.gather(blk, kept), _next_probe(a.gather(g, kept))
        else:
            xg = cand * a.const(GAMMA)
            for key in keys:
                kept = survivors(mulhi64(mix64(xg + key), m))
                cand, xg = a.gather(cand, kept), a.gather(xg, kept)
        found.append(cand.astype(np.uint32) if narrow else cand)
        total += cand.shape[0]
        if total > limit:
            break
    out = xp.concat(found) if len(found) > 1 else found[0]
    return out[:limit + 1] if out.shape[0] > limit else out


def np_query(payload: bytes, size: int, k: int, seed: int, d: int, limit: int, family: str = "blocked") -> np.ndarray:
    """:func:`query` on the host (uint64 positives)."""
    return query(payload, size, k, seed, d, limit, family)


def select_random(P, r: int, draw_seed: int):
    """P1: the ``r`` positives of smallest priority ``mix64(draw_seed + (x+1)*GAMMA)`` (ties by x,
    though distinct x have distinct priorities), ascending; ``P`` ascending words. NumPy positives
    take the radix selection of the C++ kernel (:func:`_select_random_radix`, no array per
    positive); a torch tensor sorts its priorities on its device."""
    if not arrays.is_torch(P):
        return _select_random_radix(np.asarray(P), r, draw_seed)
    a, xp = arrays.adapter(P), arrays.namespace(P)
    prio = mix64(a.const(draw_seed) + (P + a.const(1)) * a.const(GAMMA))
    order = xp.argsort(a.order_key(prio), stable=True)[:r]   # P ascending: a stable sort breaks ties by x
    return xp.sort(P[order])


_RADIX = 16
_FEW = 1 << 16   # the radix selection collects its candidates once at most this many are left


def _priority(x: np.ndarray, draw_seed: int) -> np.ndarray:
    return mix64(np.uint64(draw_seed) + (x.astype(np.uint64) + np.uint64(1)) * np.uint64(GAMMA))


def _select_random_radix(P: np.ndarray, r: int, draw_seed: int) -> np.ndarray:
    """P1 on NumPy positives, as ``select_random`` in csrc/bloom/bloom.cpp: the r-th smallest
    priority is found 16 bits a pass (a histogram of the priorities that share the bits found so
    far, over chunks of P), its few candidates then partitioned; one more pass keeps the positives
    at most that threshold. Priorities are distinct, so exactly r are kept, in P's order."""
    if r == 0:
        return P[:0]
    chunks = [P[lo:lo + _CHUNK] for lo in range(0, P.size, _CHUNK)]

    def candidates(x: np.ndarray, known: int, prefix: int) -> np.ndarray:
        v = _priority(x, draw_seed)
        return v[(v >> np.uint64(64 - known)) == np.uint64(prefix)] if known else v

    prefix, known, rank, left = 0, 0, r, P.size
    while left > _FEW:
        shift, hist = np.uint64(64 - known - _RADIX), np.zeros(1 << _RADIX, dtype=np.int64)
        for x in chunks:
            top = (candidates(x, known, prefix) >> shift) & np.uint64((1 << _RADIX) - 1)
            hist += np.bincount(top.astype(np.intp), minlength=1 << _RADIX)
        cum = np.cumsum(hist)
        b = int(np.searchsorted(cum, rank))   # the first bucket whose running count reaches rank
        rank -= int(cum[b - 1]) if b else 0
        prefix, known, left = prefix << _RADIX | b, known + _RADIX, int(hist[b])
    few = np.concatenate([candidates(x, known, prefix) for x in chunks])
    threshold = np.partition(few, rank - 1)[rank - 1]
    return np.concatenate([x[_priority(x, draw_seed) <= threshold] for x in chunks])


def np_select_random(P: np.ndarray, r: int, draw_seed: int) -> np.ndarray:
    """:func:`select_random` on the host."""
    return select_random(np.asarray(P, dtype=np.uint64), r, draw_seed)


def np_select_conflict(P: np.ndarray, r: int, size: int, k: int, seed: int, draw_seed: int,
                       family: str = "blocked") -> np.ndarray:
    """P2: Algorithm 1 over the conflict sets of the positives (reading in docs/bloom.md); the twin
    of ``select_conflict`` in csrc/bloom/bloom.cpp, with its two phases.

    The first pass serves the singleton sets, in bit order, before any larger one; they never
    draw, so that prefix is vectorised: each chooses its member unless already chosen, up to r.
    It runs window by window (:func:`_windows`: whole blocks of the blocked family), so that only
    one window's (bit, member) pairs exist at once, each one sorted uint64 ``local bit << 32 |
    member`` (members are ranks into ``P``). The passes over the larger sets then run as written
    (:func:`_greedy`), over the sets that still have an unchosen member (a set without one gives
    nothing and draws nothing when visited), listed 4 bytes per (set, member).
    """
    P = np.asarray(P)
    if r == 0:
        return np.zeros(0, dtype=np.uint64)
    chosen = np.zeros(P.size, dtype=bool)
    nchosen, opened = 0, []
    for members, keys, to_bit in _windows(P, size, k, seed, family):
        total = keys.size
        if k > 1:   # a member repeating a bit is in that set once: its repeats become the largest key
            keys.sort(axis=1)
            repeat = keys[:, 1:] == keys[:, :-1]
            total -= int(np.count_nonzero(repeat))
        keys <<= np.uint64(32)   # (members, k) local bits, turned in place into sorted pair keys
        keys |= members[:, None]
        if k > 1:
            keys[:, 1:][repeat] = np.uint64(MASK64)
            del repeat
        keys = keys.ravel()
        keys.sort()
        member, local = _halves(keys[:total], copy=False)   # local: a view of keys, read once here
        starts = np.flatnonzero(np.concatenate(([True], local[1:] != local[:-1])))
        sizes = np.diff(np.append(starts, total))
        local = local[starts]   # each set's local bit
        member = member.copy()
        del keys
        served = member[starts[sizes == 1]]   # singleton members, ascending bit: none chosen yet
        fresh = np.zeros(served.size, dtype=bool)
        fresh[np.unique(served, return_index=True)[1]] = True
        cut = int(np.searchsorted(np.cumsum(fresh), r - nchosen))   # the singleton at which nchosen reaches r
        chosen[served[:cut + 1]] = True
        nchosen += int(np.count_nonzero(fresh[:cut + 1]))
        if nchosen == r:
            break
        keep = ~chosen[member]   # every singleton chose: the larger sets, listing their unchosen members
        listed = np.add.reduceat(keep, starts, dtype=np.int64)
        sets = np.flatnonzero(listed)
        opened.append((to_bit(local[sets].astype(np.uint64)), sizes[sets], listed[sets], member[keep]))
        del member, local, keep
    if nchosen < r and opened:
        bits, sizes, listed, members = (np.concatenate(part) for part in zip(*opened))
        del opened
        index = _Unchosen(bits, listed, members)
        visit = np.lexsort((bits, sizes)).tolist()   # by (size, bit)

        def probes(m: int) -> np.ndarray:
            return np.unique(positions(P[m:m + 1].astype(np.uint64), size, k, seed, family))

        nchosen = _greedy(index, visit, probes, chosen, nchosen, r, draw_seed)
    if nchosen != r:
        raise ContainerError("Bloom P2: the positives do not cover r distinct indices")
    return P[chosen].astype(np.uint64)


def _halves(x: np.ndarray, copy: bool = True):
    """(low, high) 32-bit halves of uint64 ``x`` as uint32 arrays: copies (4 bytes each, no uint64
    temporary), or strided views of ``x`` with ``copy=False``."""
    pairs = x.view(np.uint32).reshape(-1, 2)
    low, high = (pairs[:, 0], pairs[:, 1]) if sys.byteorder == "little" else (pairs[:, 1], pairs[:, 0])
    return (low.copy(), high.copy()) if copy else (low, high)


#: (bit, member) pairs of one window of np_select_conflict (a block with more is a window alone)
_WINDOW = 1 << 21
_WINDOW_BLOCKS = 1 << 22   # blocks a window may span: its local bits stay below 2**31


def _windows(P: np.ndarray, size: int, k: int, seed: int, family: str):
    """``(members, local bits, to_bit)`` of np_select_conflict's windows, in ascending bit order:
    ``members`` ranks into ``P`` (uint32, ascending within a block), ``local bits`` their (n, k)
    filter bits renumbered below 2**32 in the same order (uint64), ``to_bit`` the map back.
    Blocked family: the positives grouped by block (one sort of ``block << 32 | rank``, 8 bytes
    each), cut into runs of whole blocks with at most _WINDOW pairs (or one block) and
    _WINDOW_BLOCKS blocks. SplitMix64 (v1) sets span the whole filter: one window."""
    if family != "blocked":
        bits = positions(P.astype(np.uint64), size, k, seed, family)
        if size <= 1 << 32:
            yield np.arange(P.size, dtype=np.uint32), bits, lambda local: local
            return
        table, dense = np.unique(bits, return_inverse=True)   # the distinct bits, ascending
        yield np.arange(P.size, dtype=np.uint32), dense.reshape(bits.shape).astype(np.uint64), lambda local: table[local]
        return
    key = np.uint64(blocked_key(seed))
    grouped = np.empty(P.size, dtype=np.uint64)
    for lo in range(0, P.size, _CHUNK):
        h = mix64(P[lo:lo + _CHUNK].astype(np.uint64) * np.uint64(GAMMA) + key)
        grouped[lo:lo + h.size] = ((h >> np.uint64(32)) * np.uint64(size)) >> np.uint64(32) << np.uint64(32)
    grouped |= np.arange(P.size, dtype=np.uint32)
    grouped.sort()
    ranks, blocks = _halves(grouped)
    del grouped
    ends = np.append(np.flatnonzero(blocks[1:] != blocks[:-1]) + 1, blocks.size)   # each block's group
    block_of = blocks[ends - 1].astype(np.int64)
    del blocks
    group = 0
    while group < ends.size:
        lo = int(ends[group - 1]) if group else 0
        last = int(np.searchsorted(ends, lo + max(1, _WINDOW // k), side="right")) - 1
        last = min(last, int(np.searchsorted(block_of, block_of[group] + _WINDOW_BLOCKS)) - 1)
        last = max(last, group)
        members = ranks[lo:ends[last]]
        base = int(block_of[group]) * BLOCK_BITS
        bits = np.empty((members.size, k), dtype=np.uint64)
        for at in range(0, members.size, _CHUNK):
            part = members[at:at + _CHUNK]
            bits[at:at + part.size] = blocked_positions(P[part].astype(np.uint64), size, k, seed)
        bits -= np.uint64(base)
        yield members, bits, lambda local, base=base: local + np.uint64(base)
        group = last + 1


class _Unchosen:
    """The members not yet chosen of each listed conflict set, ascending, indexed so that finding
    the i-th of a set and removing a chosen member from a set cost O(log set size): the slots of
    each set hold a Fenwick tree of the members removed (a dict: only the nodes a removal reached).
    Rescanning a set's members on every visit instead made an all-ones filter cost passes x
    positives. The twin of ``Unchosen`` in csrc/bloom/bloom.cpp.

    ``bits``: the sets' filter bits, ascending; ``listed``: how many members each lists;
    ``members``: the listed members (indices into the positives), set after set, ascending within one.
    """

    def __init__(self, bits: np.ndarray, listed: np.ndarray, members: np.ndarray) -> None:
        self.bits, self.members = bits, members
        self.bounds = array("q", np.concatenate(([0], np.cumsum(listed))).astype(np.int64).tobytes())
        self.live = array("q", listed.astype(np.int64).tobytes())
        self.removed = {}   # slot lo + j (node j of the set starting at lo, from 1): members removed

    def nth(self, s: int, i: int) -> int:
        """The ``i``-th (from 0) unchosen member of set ``s``: a Fenwick descent (node j covers the
        ``j & -j`` slots up to slot j, of which ``step - removed`` are unchosen)."""
        lo, removed = self.bounds[s], self.removed
        n = self.bounds[s + 1] - lo
        at, step = 0, 1 << (n.bit_length() - 1)
        while step:
            if at + step <= n:
                free = step - removed.get(lo + at + step, 0)
                if free <= i:
                    at += step
                    i -= free
            step >>= 1
        return int(self.members[lo + at])

    def remove(self, bits: np.ndarray, member: int) -> None:
        """Mark ``member`` chosen in the listed sets of its distinct filter ``bits``."""
        found = np.searchsorted(self.bits, bits)
        hit = found < self.bits.size
        found = found[hit][self.bits[found[hit]] == bits[hit]]
        removed = self.removed
        for s in found.tolist():
            lo = self.bounds[s]
            n = self.bounds[s + 1] - lo
            j = int(np.searchsorted(self.members[lo:lo + n], member)) + 1
            if j > n or self.members[lo + j - 1] != member:
                continue
            self.live[s] -= 1
            while j <= n:
                removed[lo + j] = removed.get(lo + j, 0) + 1
                j += j & -j


def _greedy(sets: _Unchosen, visit: list, probes, chosen: np.ndarray, nchosen: int, r: int,
            draw_seed: int) -> int:
    """Algorithm 1's passes over ``sets`` in the order ``visit``, from ``nchosen`` chosen: each set
    gives one unchosen member (drawn when it has several) and stays for the next pass while it
    had several; stop at r. ``probes(member)``: the member's distinct filter bits. Returns the new
    count."""
    active, draw = visit, 0
    while nchosen < r and active:
        following = []
        for s in active:
            if nchosen == r:
                break
            cand = sets.live[s]
            if cand == 0:
                continue
            pick = 0
            if cand > 1:
                draw += 1
                pick = (mix64_int(draw_seed + draw * GAMMA) * cand) >> 64
                following.append(s)
            member = sets.nth(s, pick)
            sets.remove(probes(member), member)
            chosen[member] = True
            nchosen += 1
        active = following
    return nchosen


# ---------------------------------------------------------------------------------- wire params
class BloomParams(NamedTuple):
    """The codec's wire parameters; ``size`` is the block count (blocked) or ``m`` (splitmix)."""

    family: str
    policy: str
    k: int
    size: int
    seed: int
    draw_seed: int

    @property
    def filter_bytes(self) -> int:
        return self.size * BLOCK_BYTES if self.family == "blocked" else (self.size + 7) // 8


# The params rules have one C++ definition (csrc/bloom/bloom_wire.cpp, the one the TensorFlow ops
# run), called through deepreduce._bloom when it is built; the *_python functions are the fallback
# (tests check that both give the same bytes, fields and error texts).
@functools.lru_cache(maxsize=256)   # the same few values for a model's tensors, step after step
def pack_params(policy: str, k: int, blocks: int, seed: int, draw_seed: int) -> bytes:
    """Blocked-family params: ``0x10 | policy`` u8, k u8, blocks and hash seed as varints, draw seed
    u64 for p1/p2."""
    native = _native.load("bloom")
    if native is not None:
        return native.pack_params(policy, k, blocks, seed, draw_seed)
    return pack_params_python(policy, k, blocks, seed, draw_seed)


def pack_params_python(policy: str, k: int, blocks: int, seed: int, draw_seed: int) -> bytes:
    """:func:`pack_params` without the extension."""
    out = bytes((BLOCKED << 4 | _POLICY_CODE[policy], k)) + varint.encode(blocks) + varint.encode(seed)
    return out + (_DRAW.pack(draw_seed) if policy in DRAWING else b"")


def unpack_params(params: bytes) -> BloomParams:
    """Parse and check the params of either family; ContainerError names the bad field."""
    return _unpack_params(bytes(params))


@functools.lru_cache(maxsize=256)   # every container of a tensor carries the same params (P0)
def _unpack_params(params: bytes) -> BloomParams:
    native = _native.load("bloom")
    if native is None:
        return unpack_params_python(params)
    try:
        return BloomParams(*native.unpack_params(params))
    except ValueError as exc:
        raise ContainerError(str(exc)) from None


def unpack_params_python(params: bytes) -> BloomParams:
    """:func:`unpack_params` without the extension."""
    if len(params) < 2:
        raise ContainerError(f"Bloom params have {len(params)} bytes; at least 2 needed")
    code, k = params[0], params[1]
    family_code, policy_code = code >> 4, code & 0x0F
    if family_code >= len(FAMILIES) or policy_code >= len(POLICIES):
        raise ContainerError(f"Bloom params name unknown family/policy code 0x{code:02x}")
    if not 1 <= k <= MAX_K:
        raise ContainerError(f"Bloom params give k = {k}; allowed 1..{MAX_K}")
    policy = POLICIES[policy_code]
    if FAMILIES[family_code] == "splitmix":
        if len(params) != _SPLITMIX_PARAMS.size:
            raise ContainerError(f"Bloom params have {len(params)} bytes, expected {_SPLITMIX_PARAMS.size}")
        _, _, m, seed, draw_seed = _SPLITMIX_PARAMS.unpack(params)
        return BloomParams("splitmix", policy, k, m, seed, draw_seed)
    blocks, pos = varint.decode(params, 2, "Bloom blocks")
    seed, pos = varint.decode(params, pos, "Bloom hash seed")
    draw_seed = 0
    if policy in DRAWING:
        if len(params) - pos < _DRAW.size:
            raise ContainerError("Bloom params end before the draw seed")
        (draw_seed,) = _DRAW.unpack_from(params, pos)
        pos += _DRAW.size
    if pos != len(params):
        raise ContainerError(f"Bloom params have {len(params) - pos} bytes after their last field")
    if blocks > MAX_BLOCKS:
        raise ContainerError(f"Bloom params give {blocks} blocks; at most {MAX_BLOCKS}")
    return BloomParams("blocked", policy, k, blocks, seed, draw_seed)


def _host_tensor(x) -> bool:
    """Whether ``x`` is a torch CPU tensor that the C++ kernels read in place (extension built)."""
    return arrays.is_torch(x) and x.device.type == "cpu" and _native.load("bloom") is not None


def _host_view(x) -> np.ndarray:
    """A torch CPU tensor as NumPy (no copy for a contiguous one)."""
    return np.ascontiguousarray(x.detach().numpy())


# ---------------------------------------------------------------------------------- receiver bounds
# The constants of positive_limit (csrc/bloom/bloom.h; docs/reliability.md, "Bloom filters:
# positives and work").
POSITIVE_MARGIN = 2.0        # accepted false positives: this times the expected ...
POSITIVE_SLACK = 64          # ... plus this many
MAX_PROBE_RATE = 2.0         # every policy and family: k * rate at most this
MAX_PROBES_PER_BIT = 2       # P2 with k >= 2: k * r at most this times m
MAX_KEYS_PER_SET_BIT = 64    # P2: r at most this times the set bits
_POPCOUNT = np.array([bin(v).count("1") for v in range(256)], dtype=np.uint8)


def _power(x: float, k: int) -> float:
    """x**k by k multiplications: the same bits as the C++ twin."""
    t = 1.0
    for _ in range(k):
        t *= x
    return t


def positive_limit(section, size: int, k: int, r: int, d: int, family: str = "blocked",
                   conflict: bool = False, like=None) -> int:
    """The most positives among ``[0, d)`` the receiver accepts from a filter claiming at most
    ``r`` keys (the header's count), and the refusal (ValueError) of a filter no encoder writes:
    the twin of ``bloom::positive_limit`` (csrc/bloom/bloom.h) for the NumPy and torch paths.

    The filter's own false-positive rate is the chance that the ``k`` probes of a position never
    inserted all hit set bits: the mean over blocks of ``(set bits / 512)**k`` (blocked),
    ``(set bits / m)**k`` (splitmix). An honest filter has its ``r`` keys plus Binomial(d - r,
    rate) false positives, so at most ``min(d, r + ceil(2 rate d) + 64)`` are accepted; it has at
    most ``k r`` set bits (each one a probe of a key) and, whatever the policy and family,
    ``k rate <= 2`` (encoders stay below 0.76). P2's conflict sets hold ``k |P|`` pairs visited in
    about ``r / set bits`` passes: it also needs ``k r <= 2 m`` when ``k >= 2``, and ``r <= 64`` set bits.
    """
    a = arrays.adapter(like)
    packed = a.from_section(section, "<u1", like)
    xp = arrays.namespace(packed)
    lut = a.from_numpy(_POPCOUNT, packed)
    ones = a.gather(lut, a.index(a.words(packed)))   # set bits per byte
    if family == "blocked":
        m = size * BLOCK_BITS
        per_block = a.to_numpy(xp.sum(xp.reshape(ones, (size, BLOCK_BYTES)), axis=1, dtype=xp.int64))
        hist = np.bincount(per_block, minlength=BLOCK_BITS + 1).tolist()   # blocks by their set bits
        set_bits = sum(c * n for c, n in enumerate(hist))
        total = 0.0
        for c, n in enumerate(hist):
            if n:
                total += float(n) * _power(c / 512.0, k)
        rate = total / float(size) if size else 0.0
    else:
        m = size
        set_bits = int(xp.sum(ones, dtype=xp.int64))
        rate = _power(float(set_bits) / float(size), k) if size else 0.0
    if set_bits > k * r:   # ValueError, as the C++ module raises (the codec reports it as ContainerError)
        raise ValueError(f"Bloom filter has {set_bits} bits set; {r} keys of k = {k} hashes set at most "
                         f"{min(k * r, MASK64)}")
    if k * rate > MAX_PROBE_RATE:
        raise ValueError(f"Bloom filter claims {r} keys with k = {k} hashes at its false-positive rate {rate:.3g}: "
                         "k * rate above 2, a filter far fuller than its k was chosen for")
    if conflict:   # ValueError, as the C++ module raises (the codec reports both as ContainerError)
        keys = f"Bloom P2 filter claims {r} keys"
        if k >= 2 and k * r > MAX_PROBES_PER_BIT * m:
            raise ValueError(f"{keys} with k = {k} hashes in {m} bits: k * r above twice the bits, beyond "
                                 "any encoder's sizing")
        if r > MAX_KEYS_PER_SET_BIT * set_bits:
            raise ValueError(f"{keys} on {set_bits} set bits: more than 64 keys per set bit, beyond any "
                                 "encoder's sizing")
    extra = POSITIVE_MARGIN * rate * float(d)
    if extra >= float(d):
        return d
    return min(d, r + math.ceil(extra) + POSITIVE_SLACK)


def check_positives(policy: str, npos: int, count: int, limit: int) -> None:
    """The receiver's check that the filter backs the header's value count (``limit``: the
    query's, :func:`positive_limit` for the policies that take every positive)."""
    if policy == "p0" and npos != count:
        raise ContainerError(f"Bloom P0 filter has {npos}{'+' if npos > count else ''} positives, header says {count}")
    if npos < count:
        raise ContainerError(f"Bloom filter has {npos} positives, fewer than the {count} values sent")
    if npos > limit and policy not in PREFIX:
        raise ContainerError(f"Bloom {policy} filter has more than {limit} positives: more than a filter holding "
                             f"{count} keys has at its own false-positive rate")


class _errors:
    """Argument errors of the kernels (ValueError, TypeError, OverflowError) as deepreduce errors
    (a plain context manager: it is entered for every tensor of every step)."""

    __slots__ = ("error", "what")

    def __init__(self, error: type, what: str) -> None:
        self.error, self.what = error, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is not None and issubclass(kind, (ValueError, TypeError, OverflowError)) \
                and not issubclass(kind, DeepReduceError):
            raise self.error(f"{self.what}: {exc}") from exc
        return False


# ---------------------------------------------------------------------------------- codec
@register
class BloomIndex(IndexCodec):
    """Bloom filter index codec (DeepReduce BF-naive/P0/P1/P2/deterministic policies)."""

    id = "bloom"
    wire_id = 1
    keeps_order = False
    array_api = True
    PARAMS = {
        "policy": Param(str, default="p0", choices=POLICIES, doc="which positives carry values"),
        "fpr": Param(float, default=0.001, low=MIN_FPR, high=1.0, high_open=True,
                     doc="target false-positive rate; sets the block count and k"),
        "hash_seed": Param(int, default=0, low=0, high=MASK64, doc="seed of the hash family"),
    }

    @property
    def cpu_tensor_kernels(self) -> bool:
        """Whether torch CPU tensors are encoded and decoded by the C++ kernels on their memory
        (the extension is built; see :meth:`encode`)."""
        return _native.load("bloom") is not None

    # -- backend dispatch ---------------------------------------------------------------
    def _kernels(self, like):
        """The C++ module for NumPy input (None: the array path, for NumPy without the
        extension or for torch tensors on their device)."""
        if arrays.is_torch(like):
            return None
        native = _native.load("bloom")
        self.backend = "c++" if native is not None else "numpy"
        return native

    def _query(self, native, p: BloomParams, payload, d: int, limit: int, like):
        if native is not None:
            return native.query(payload, p.size, p.k, p.seed, d, limit, self.threads, p.family)
        return query(payload, p.size, p.k, p.seed, d, limit, p.family, like)

    def _positive_limit(self, native, p: BloomParams, payload, r: int, d: int) -> int:
        if native is not None:
            return native.positive_limit(payload, p.size, p.k, r, d, p.family, p.policy == "p2")
        return positive_limit(payload, p.size, p.k, r, d, p.family, p.policy == "p2", payload)

    def _select(self, native, p: BloomParams, P, r: int):
        policy, npos = p.policy, P.shape[0]
        if policy in ("naive", "leftmost"):
            return P[:r]
        if policy == "rightmost":
            return P[npos - r:]
        if policy == "middle":
            o = (npos - r) // 2
            return P[o:o + r]
        if policy == "p1":
            if native is not None:
                return native.select_random(P, r, p.draw_seed)
            return select_random(P, r, p.draw_seed)
        if policy == "p2":
            if arrays.is_torch(P):   # Algorithm 1 is sequential: the positives (compact) go to the host
                arrays.host_fallback("Bloom P2 conflict selection")
                host = self._select(_native.load("bloom"), p, arrays.adapter(P).to_numpy(P).view(np.uint64), r)
                return arrays.adapter(P).from_numpy(host.view(np.int64), P)
            if native is not None:
                return native.select_conflict(P, r, p.size, p.k, p.seed, p.draw_seed, p.family)
            return np_select_conflict(P, r, p.size, p.k, p.seed, p.draw_seed, p.family)
        return P  # p0

    # -- encode / decode ----------------------------------------------------------------
    def encode(self, indices, values, dense, ctx):
        """Written against the array namespace: NumPy input runs the C++ kernels (or NumPy),
        torch input runs on the tensors' device (only P2's conflict selection visits the host).

        A torch tensor on the CPU is host memory: with the extension built, the C++ kernels
        encode it through zero-copy NumPy views (the same bytes). The array path would scan its
        ``d`` positions with some 40 torch operations per chunk, each a pass over a fresh
        temporary, that torch spreads over its intra-op threads beyond 32768 elements: 10 to 100
        times the C++ scan's CPU time on a busy host (docs/reliability.md, round 3)."""
        if _host_tensor(dense):
            a = arrays.adapter(dense)
            enc = self.encode(*(_host_view(x) for x in (indices, values, dense)), ctx)
            return enc._replace(indices=a.from_numpy(enc.indices, dense), values=a.from_numpy(enc.values, dense))
        native = self._kernels(dense)
        a, xp = arrays.adapter(dense), arrays.namespace(dense)
        d = int(dense.shape[0])
        indices, values = sorted_pairs(indices, values, dense)
        r = int(indices.shape[0])
        blocks, k = filter_params(r, self.fpr)
        draw_seed = ctx.seed_for(f"bloom-{self.policy}") if self.policy in DRAWING else 0
        p = BloomParams("blocked", self.policy, k, blocks, self.hash_seed, draw_seed)
        idx64 = a.words(indices)
        with _errors(DeepReduceError, "Bloom encode"):
            if native is not None:
                payload = native.build(idx64, blocks, k, p.seed, self.threads)
            else:
                payload = build(idx64, blocks, k, p.seed)
            limit = r if self.policy in ("naive", "leftmost") else d
            P = self._query(native, p, payload, d, limit, dense)
            chosen = a.index(self._select(native, p, P, r))
        sent = values if self.policy == "naive" else dense[chosen]
        params = pack_params(self.policy, k, blocks, p.seed, draw_seed)
        sent = sent.astype(np.float32, copy=False) if native is not None else xp.astype(sent, xp.float32, copy=False)
        return IndexEncoding(params, payload, chosen, sent)

    def decode(self, params, payload, count, numel):
        """Positions as int64: NumPy for a ``bytes`` section, torch on the section's device for a
        uint8 tensor (a CPU one through the C++ kernels, as in :meth:`encode`). With the C++
        kernels, one call to their decode (csrc/bloom/bloom_wire.h), whose positives are a bitmap
        of ``numel`` bits; otherwise the array path below, its twin."""
        if _host_tensor(payload):
            return arrays.adapter(payload).from_numpy(self.decode(params, _host_view(payload).tobytes(), count, numel),
                                                      payload)   # the filter: as compact as the container
        native = self._kernels(payload)
        a = arrays.adapter(payload)
        if native is not None:
            try:
                return a.index(native.decode(bytes(params), payload, count, numel, self.threads))
            except ValueError as exc:   # ErrorKind::CONTAINER, with the text of the checks below
                raise ContainerError(str(exc)) from None
        p = unpack_params(params)
        if len(payload) != p.filter_bytes:
            unit = f"{p.size} blocks" if p.family == "blocked" else f"m = {p.size}"
            raise ContainerError(f"Bloom section has {len(payload)} bytes, expected {p.filter_bytes} for {unit}")
        if p.family == "splitmix" and p.size % 8 and int(payload[-1]) >> (p.size % 8):
            raise ContainerError("Bloom section has bits set beyond m")
        if p.size == 0:
            if count:
                raise ContainerError(f"empty Bloom filter cannot carry {count} indices")
            return a.from_numpy(np.zeros(0, dtype=np.int64), payload)
        try:
            with _errors(ContainerError, "Bloom decode"):
                limit = self._positive_limit(native, p, payload, count, numel)
                if p.policy in PREFIX:
                    limit = count
                P = self._query(native, p, payload, numel, limit, payload)
                check_positives(p.policy, P.shape[0], count, limit)
                return a.index(self._select(native, p, P, count))
        except MemoryError:   # the C++ decode's words for the same failure (bloom_wire.cpp)
            unit = f"{p.size} blocks" if p.family == "blocked" else f"m = {p.size}"
            raise ContainerError(f"Bloom decode ran out of memory: a {p.policy} filter of {unit} and k = {p.k} "
                                 f"claims {count} keys over {numel} positions") from None

    @classmethod
    def describe_params(cls, params: bytes) -> dict:
        p = unpack_params(params)
        out = {"family": p.family, "policy": p.policy, "k": p.k, "hash_seed": p.seed, "draw_seed": p.draw_seed}
        out.update({"blocks": p.size, "m": p.size * BLOCK_BITS} if p.family == "blocked" else {"m": p.size})
        return out
