"""Bloom filter index codec with every DeepReduce policy (spec doc §1.2-§1.7).

The sender inserts the sparsifier's support ``S`` into a Bloom filter of ``m`` bits and ``k``
hash functions, derived from ``(r, fpr)`` as in spec §1.2::

    k = ceil(log2(1/fpr))        m = ceil(log2(1/fpr) * r / ln 2)

Both sides query every position of the tensor; the positives ``P`` (ascending) contain ``S``
plus false positives. A policy then decides what travels:

* ``naive``: the ``r`` values of ``S`` (ascending); the receiver puts them on the first ``r``
  positives, so one false positive shifts every later value (the paper's baseline).
* ``p0``: every positive, with its value from the dense gradient; lossless on ``S``.
* ``p1``: ``r`` positives drawn uniformly without replacement from a seeded stream.
* ``p2``: ``r`` positives picked from conflict sets, smallest first (Algorithm 1).
* ``leftmost``, ``middle``, ``rightmost``: a deterministic window of ``r`` positives.

Except for ``naive`` the values come from the dense (compensated) gradient. The hash family,
the draw streams and the wire layout are in docs/bloom.md; the NumPy path below produces the
same bytes and the same choices as the C++ kernels in ``csrc/bloom`` (tests compare them).

Wire params (26 bytes, little-endian): policy u8 | k u8 | m u64 | hash seed u64 | draw seed
u64. Payload: the ``ceil(m/8)`` filter bytes, bit ``j`` at bit ``j % 8`` of byte ``j // 8``.
The header's value count is ``|P|`` for ``p0`` and ``r`` otherwise.
"""
from __future__ import annotations

import math
import struct

import numpy as np

from .. import _native
from ..errors import ContainerError
from ..params import Param
from ..registry import register
from ._base import IndexCodec, IndexEncoding

POLICIES = ("naive", "p0", "p1", "p2", "leftmost", "middle", "rightmost")
_POLICY_CODE = {name: code for code, name in enumerate(POLICIES)}
_PARAMS = struct.Struct("<BBQQQ")
MAX_K = 64

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GAMMA = np.uint64(GAMMA)
_LO32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_CHUNK = 1 << 20


# ---------------------------------------------------------------------------------- hash family
def mix64_int(z: int) -> int:
    """SplitMix64's finaliser on a Python int (mod 2**64)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, element-wise on uint64 (wrapping arithmetic, like C++)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def mulhi64(a: np.ndarray, b: int) -> np.ndarray:
    """floor(a * b / 2**64) for uint64 ``a`` and an integer ``0 <= b < 2**64`` (exact)."""
    bh, bl = np.uint64(b >> 32), np.uint64(b & 0xFFFFFFFF)
    ah, al = a >> _S32, a & _LO32
    ll, lh, hl, hh = al * bl, al * bh, ah * bl, ah * bh
    mid = (ll >> _S32) + (lh & _LO32) + (hl & _LO32)
    return hh + (lh >> _S32) + (hl >> _S32) + (mid >> _S32)


def hash_key(seed: int, i: int) -> int:
    """``key_i = mix64(seed + (i+1) * GAMMA)``: the i-th output of SplitMix64 seeded with ``seed``."""
    return mix64_int(seed + (i + 1) * GAMMA)


def positions(x: np.ndarray, m: int, k: int, seed: int) -> np.ndarray:
    """``h_i(x) = floor(mix64(key_i + x*GAMMA) * m / 2**64)`` as an (n, k) uint64 array."""
    x = np.asarray(x, dtype=np.uint64)
    out = np.empty((x.size, k), dtype=np.uint64)
    xg = x * _GAMMA
    for i in range(k):
        out[:, i] = mulhi64(mix64(xg + np.uint64(hash_key(seed, i))), m)
    return out


def filter_params(r: int, fpr: float) -> tuple:
    """``(m, k)`` for ``r`` indices at false-positive rate ``fpr`` (spec §1.2, REF-CODE rounding)."""
    bits_per_fp = math.log2(1.0 / fpr)
    k = min(MAX_K, max(1, math.ceil(bits_per_fp)))
    m = math.ceil(bits_per_fp * r / math.log(2)) if r else 0
    return max(m, 1) if r else 0, k


def theoretical_fpr(m: int, k: int, r: int) -> float:
    """``(1 - exp(-k r / m))**k``, the false-positive rate of a filter holding ``r`` indices."""
    return (1.0 - math.exp(-k * r / m)) ** k if m else 1.0


# ---------------------------------------------------------------------------------- NumPy path
def np_build(indices: np.ndarray, m: int, k: int, seed: int) -> bytes:
    bits = np.zeros(m, dtype=bool)
    if len(indices):
        bits[positions(indices, m, k, seed).ravel().astype(np.int64)] = True
    return np.packbits(bits, bitorder="little").tobytes()


def np_query(payload: bytes, m: int, k: int, seed: int, d: int, limit: int) -> np.ndarray:
    """Positives in [0, d) ascending; stops after the chunk where more than ``limit`` appear."""
    if m == 0 or d == 0:
        return np.zeros(0, dtype=np.uint64)
    bits = np.unpackbits(np.frombuffer(payload, dtype=np.uint8), bitorder="little", count=m).astype(bool)
    keys = [np.uint64(hash_key(seed, i)) for i in range(k)]
    found, total = [], 0
    for base in range(0, d, _CHUNK):
        cand = np.arange(base, min(d, base + _CHUNK), dtype=np.uint64)
        xg = cand * _GAMMA
        for key in keys:  # early exit: each function only tests the survivors of the previous ones
            keep = bits[mulhi64(mix64(xg + key), m).astype(np.int64)]
            cand, xg = cand[keep], xg[keep]
            if not cand.size:
                break
        found.append(cand)
        total += cand.size
        if total > limit:
            break
    return np.concatenate(found) if found else np.zeros(0, dtype=np.uint64)


def np_select_random(P: np.ndarray, r: int, draw_seed: int) -> np.ndarray:
    """P1: the ``r`` positives of smallest priority ``mix64(draw_seed + (x+1)*GAMMA)`` (ties by x)."""
    P = np.asarray(P, dtype=np.uint64)
    prio = mix64(np.uint64(draw_seed) + (P + np.uint64(1)) * _GAMMA)
    order = np.lexsort((P, prio))[:r]
    return np.sort(P[order])


def np_select_conflict(P: np.ndarray, r: int, m: int, k: int, seed: int, draw_seed: int) -> np.ndarray:
    """P2: Algorithm 1 over the conflict sets of the positives (reading in docs/bloom.md)."""
    P = np.asarray(P, dtype=np.uint64)
    if r == 0:
        return np.zeros(0, dtype=np.uint64)
    pos = positions(P, m, k, seed)
    owner = np.repeat(np.arange(P.size, dtype=np.int64), k)
    flat = pos.ravel()
    # Distinct (bit, positive) pairs, grouped by bit, members ascending.
    order = np.lexsort((owner, flat))
    flat, owner = flat[order], owner[order]
    first = np.ones(flat.size, dtype=bool)
    first[1:] = (flat[1:] != flat[:-1]) | (owner[1:] != owner[:-1])
    flat, owner = flat[first], owner[first]
    bits, starts, sizes = np.unique(flat, return_index=True, return_counts=True)
    set_order = np.lexsort((bits, sizes))  # by (size, bit)
    chosen = np.zeros(P.size, dtype=bool)
    nchosen, draw = 0, 0
    active = [(int(starts[s]), int(starts[s] + sizes[s])) for s in set_order]
    while nchosen < r and active:
        following = []
        for lo, hi in active:
            if nchosen == r:
                break
            members = owner[lo:hi]
            cand = members[~chosen[members]]
            if cand.size == 0:
                continue
            pick = 0
            if cand.size > 1:
                draw += 1
                u = mix64_int(draw_seed + draw * GAMMA)
                pick = (u * cand.size) >> 64
                following.append((lo, hi))
            chosen[cand[pick]] = True
            nchosen += 1
        active = following
    if nchosen != r:
        raise ContainerError("Bloom P2: the positives do not cover r distinct indices")
    return P[chosen]


# ---------------------------------------------------------------------------------- codec
@register
class BloomIndex(IndexCodec):
    """Bloom filter index codec (DeepReduce BF-naive/P0/P1/P2/deterministic policies)."""

    id = "bloom"
    wire_id = 1
    keeps_order = False
    PARAMS = {
        "policy": Param(str, default="p0", choices=POLICIES, doc="which positives carry values"),
        "fpr": Param(float, default=0.001, low=0.0, high=1.0, low_open=True, high_open=True,
                     doc="target false-positive rate; sets m and k"),
        "hash_seed": Param(int, default=0, low=0, high=MASK64, doc="seed of the hash family"),
    }

    # -- backend dispatch ---------------------------------------------------------------
    def _kernels(self):
        native = _native.load("bloom")
        self.backend = "c++" if native is not None else "numpy"
        return native

    def _query(self, native, payload, m, k, seed, d, limit) -> np.ndarray:
        if native is not None:
            return native.query(payload, m, k, seed, d, limit)
        return np_query(payload, m, k, seed, d, limit)

    def _select(self, native, policy, P, r, m, k, seed, draw_seed) -> np.ndarray:
        if policy in ("naive", "leftmost"):
            return P[:r]
        if policy == "rightmost":
            return P[P.size - r:]
        if policy == "middle":
            o = (P.size - r) // 2
            return P[o:o + r]
        if policy == "p1":
            if native is not None:
                return native.select_random(P, r, draw_seed)
            return np_select_random(P, r, draw_seed)
        if policy == "p2":
            if native is not None:
                return native.select_conflict(P, r, m, k, seed, draw_seed)
            return np_select_conflict(P, r, m, k, seed, draw_seed)
        return P  # p0

    # -- encode / decode ----------------------------------------------------------------
    def encode(self, indices, values, dense, ctx):
        native = self._kernels()
        d = int(dense.size)
        indices = np.asarray(indices, dtype=np.int64)
        order = np.argsort(indices, kind="stable")
        indices, values = indices[order], np.asarray(values)[order]
        r = int(indices.size)
        m, k = filter_params(r, self.fpr)
        seed = self.hash_seed
        draw_seed = ctx.seed_for(f"bloom-{self.policy}") if self.policy in ("p1", "p2") else 0
        idx64 = indices.astype(np.uint64)
        payload = native.build(idx64, m, k, seed) if native is not None else np_build(idx64, m, k, seed)
        limit = r if self.policy in ("naive", "leftmost") else d
        P = self._query(native, payload, m, k, seed, d, limit)
        chosen = self._select(native, self.policy, P, r, m, k, seed, draw_seed).astype(np.int64)
        sent = values if self.policy == "naive" else dense[chosen]
        params = _PARAMS.pack(_POLICY_CODE[self.policy], k, m, seed, draw_seed)
        return IndexEncoding(params, payload, chosen, np.asarray(sent, dtype=np.float32))

    def decode(self, params, payload, count, numel):
        native = self._kernels()
        policy, k, m, seed, draw_seed = _unpack_params(params)
        if len(payload) != (m + 7) // 8:
            raise ContainerError(f"Bloom section has {len(payload)} bytes, expected {(m + 7) // 8} for m = {m}")
        if m % 8 and payload[-1] >> (m % 8):
            raise ContainerError("Bloom section has bits set beyond m")
        if m == 0:
            if count:
                raise ContainerError(f"empty Bloom filter cannot carry {count} indices")
            return np.zeros(0, dtype=np.int64)
        limit = count if policy in ("naive", "leftmost", "p0") else numel
        P = self._query(native, payload, m, k, seed, numel, limit)
        if policy == "p0" and P.size != count:
            raise ContainerError(f"Bloom P0 filter has {P.size}{'+' if P.size > count else ''} positives, "
                                 f"header says {count}")
        if P.size < count:
            raise ContainerError(f"Bloom filter has {P.size} positives, fewer than the {count} values sent")
        try:
            return self._select(native, policy, P, count, m, k, seed, draw_seed).astype(np.int64)
        except ValueError as exc:
            raise ContainerError(f"Bloom {policy} selection failed: {exc}") from exc

    @classmethod
    def describe_params(cls, params: bytes) -> dict:
        policy, k, m, seed, draw_seed = _unpack_params(params)
        return {"policy": policy, "k": k, "m": m, "hash_seed": seed, "draw_seed": draw_seed}


def _unpack_params(params: bytes):
    if len(params) != _PARAMS.size:
        raise ContainerError(f"Bloom params have {len(params)} bytes, expected {_PARAMS.size}")
    code, k, m, seed, draw_seed = _PARAMS.unpack(params)
    if code >= len(POLICIES):
        raise ContainerError(f"Bloom params name unknown policy code {code}")
    if not 1 <= k <= MAX_K:
        raise ContainerError(f"Bloom params give k = {k}; allowed 1..{MAX_K}")
    return POLICIES[code], k, m, seed, draw_seed
