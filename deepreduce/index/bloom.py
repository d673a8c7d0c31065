"""Bloom filter index codec with every DeepReduce policy (spec doc §1.2-§1.7).

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

import contextlib
import functools
import math
import struct
from typing import NamedTuple

import numpy as np

from .. import _native, varint
from ..errors import ContainerError, DeepReduceError
from ..params import Param
from ..registry import register
from ._base import IndexCodec, IndexEncoding

POLICIES = ("naive", "p0", "p1", "p2", "leftmost", "middle", "rightmost")
_POLICY_CODE = {name: code for code, name in enumerate(POLICIES)}
DRAWING = ("p1", "p2")
MAX_K = 64
FAMILIES = ("splitmix", "blocked")   # index = the family code in the params' high nibble
BLOCKED = FAMILIES.index("blocked")

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GAMMA = np.uint64(GAMMA)
_LO32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_CHUNK = 1 << 20

BLOCK_BITS = 512
BLOCK_BYTES = BLOCK_BITS // 8
PROBE_MUL = 0x5BD1E995
MAX_BLOCKS = (1 << 31) - 1
_PROBE_MUL = np.uint64(PROBE_MUL)
_S23 = np.uint64(23)
_SPLITMIX_PARAMS = struct.Struct("<BBQQQ")
_DRAW = struct.Struct("<Q")


# ---------------------------------------------------------------------------------- hashing
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


def blocked_key(seed: int) -> int:
    """The blocked family's key: ``mix64(seed + GAMMA)``."""
    return mix64_int(seed + GAMMA)


def _blocked_hash(x: np.ndarray, seed: int):
    """``(block * 512, g_0)`` of uint64 indices: ``h = mix64(key + x*GAMMA)``."""
    h = mix64(np.uint64(blocked_key(seed)) + x * _GAMMA)
    return h, h & _LO32


def _block_base(h: np.ndarray, blocks: int) -> np.ndarray:
    return (((h >> _S32) * np.uint64(blocks)) >> _S32) * np.uint64(BLOCK_BITS)


def _next_probe(g: np.ndarray) -> np.ndarray:
    return (g * _PROBE_MUL) & _LO32


def blocked_positions(x: np.ndarray, blocks: int, k: int, seed: int) -> np.ndarray:
    """Global bit positions ``512*block(x) + (g_i >> 23)`` as an (n, k) uint64 array."""
    x = np.asarray(x, dtype=np.uint64)
    h, g = _blocked_hash(x, seed)
    base = _block_base(h, blocks)
    out = np.empty((x.size, k), dtype=np.uint64)
    for i in range(k):
        out[:, i] = base + (g >> _S23)
        g = _next_probe(g)
    return out


def mulhi64(a: np.ndarray, b: int) -> np.ndarray:
    """floor(a * b / 2**64) for uint64 ``a`` and an integer ``0 <= b < 2**64`` (exact)."""
    bh, bl = np.uint64(b >> 32), np.uint64(b & 0xFFFFFFFF)
    ah, al = a >> _S32, a & _LO32
    ll, lh, hl, hh = al * bl, al * bh, ah * bl, ah * bh
    mid = (ll >> _S32) + (lh & _LO32) + (hl & _LO32)
    return hh + (lh >> _S32) + (hl >> _S32) + (mid >> _S32)


def hash_key(seed: int, i: int) -> int:
    """SplitMix64 family: ``key_i = mix64(seed + (i+1) * GAMMA)``."""
    return mix64_int(seed + (i + 1) * GAMMA)


def splitmix_positions(x: np.ndarray, m: int, k: int, seed: int) -> np.ndarray:
    """SplitMix64 family: ``h_i(x) = floor(mix64(key_i + x*GAMMA) * m / 2**64)``, (n, k) uint64."""
    x = np.asarray(x, dtype=np.uint64)
    out = np.empty((x.size, k), dtype=np.uint64)
    xg = x * _GAMMA
    for i in range(k):
        out[:, i] = mulhi64(mix64(xg + np.uint64(hash_key(seed, i))), m)
    return out


def positions(x: np.ndarray, size: int, k: int, seed: int, family: str = "blocked") -> np.ndarray:
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


def filter_params(r: int, fpr: float) -> tuple:
    """``(blocks, k)`` of the blocked filter for ``r`` indices at false-positive rate ``fpr``:
    ``k`` and the keys per block ``lam`` maximise ``lam`` subject to ``blocked_fpr(lam, k) <= fpr``;
    ``blocks = ceil(r / lam)`` (``r = 0``: no blocks)."""
    lam, k = filter_shape(fpr)
    if not r:
        return 0, k
    blocks = max(1, math.ceil(r / lam))
    if blocks > MAX_BLOCKS:
        raise DeepReduceError(f"Bloom filter for {r} indices at fpr {fpr} needs {blocks} blocks; at most {MAX_BLOCKS}")
    return blocks, k


def theoretical_fpr(blocks: int, k: int, r: int) -> float:
    """The false-positive rate of a blocked filter of ``blocks`` blocks holding ``r`` indices."""
    return blocked_fpr(r / blocks, k) if blocks else 1.0


# ---------------------------------------------------------------------------------- NumPy path
def np_build(indices: np.ndarray, blocks: int, k: int, seed: int) -> bytes:
    """The blocked filter (``64 * blocks`` bytes) holding ``indices``."""
    bits = np.zeros(blocks * BLOCK_BITS, dtype=bool)
    if len(indices):
        bits[blocked_positions(indices, blocks, k, seed).ravel().astype(np.int64)] = True
    return np.packbits(bits, bitorder="little").tobytes()


def np_query(payload: bytes, size: int, k: int, seed: int, d: int, limit: int, family: str = "blocked") -> np.ndarray:
    """The first ``min(|P|, limit + 1)`` positives ``P`` in [0, d), ascending."""
    m = size * BLOCK_BITS if family == "blocked" else size
    if m == 0 or d == 0:
        return np.zeros(0, dtype=np.uint64)
    bits = np.unpackbits(np.frombuffer(payload, dtype=np.uint8), bitorder="little", count=m).astype(bool)
    keys = [np.uint64(hash_key(seed, i)) for i in range(k)]
    found, total = [], 0
    for base in range(0, d, _CHUNK):
        cand = np.arange(base, min(d, base + _CHUNK), dtype=np.uint64)
        if family == "blocked":   # each probe tests only the survivors of the previous ones
            h, g = _blocked_hash(cand, seed)
            blk = _block_base(h, size)
            for _ in range(k):
                keep = bits[(blk + (g >> _S23)).astype(np.int64)]
                cand, blk, g = cand[keep], blk[keep], _next_probe(g[keep])
        else:
            xg = cand * _GAMMA
            for key in keys:
                keep = bits[mulhi64(mix64(xg + key), m).astype(np.int64)]
                cand, xg = cand[keep], xg[keep]
        found.append(cand)
        total += cand.size
        if total > limit:
            break
    out = np.concatenate(found) if found else np.zeros(0, dtype=np.uint64)
    return out[:limit + 1] if out.size > limit else out


def np_select_random(P: np.ndarray, r: int, draw_seed: int) -> np.ndarray:
    """P1: the ``r`` positives of smallest priority ``mix64(draw_seed + (x+1)*GAMMA)`` (ties by x)."""
    P = np.asarray(P, dtype=np.uint64)
    prio = mix64(np.uint64(draw_seed) + (P + np.uint64(1)) * _GAMMA)
    order = np.lexsort((P, prio))[:r]
    return np.sort(P[order])


def np_select_conflict(P: np.ndarray, r: int, size: int, k: int, seed: int, draw_seed: int,
                       family: str = "blocked") -> np.ndarray:
    """P2: Algorithm 1 over the conflict sets of the positives (reading in docs/bloom.md)."""
    P = np.asarray(P, dtype=np.uint64)
    if r == 0:
        return np.zeros(0, dtype=np.uint64)
    pos = positions(P, size, k, seed, family)
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


def pack_params(policy: str, k: int, blocks: int, seed: int, draw_seed: int) -> bytes:
    """Blocked-family params: ``0x10 | policy`` u8, k u8, blocks and hash seed as varints, draw seed
    u64 for p1/p2."""
    out = bytes((BLOCKED << 4 | _POLICY_CODE[policy], k)) + varint.encode(blocks) + varint.encode(seed)
    return out + (_DRAW.pack(draw_seed) if policy in DRAWING else b"")


def unpack_params(params: bytes) -> BloomParams:
    """Parse and check the params of either family; ContainerError names the bad field."""
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


def check_positives(policy: str, npos: int, count: int) -> None:
    """The receiver's check that the filter backs the header's value count."""
    if policy == "p0" and npos != count:
        raise ContainerError(f"Bloom P0 filter has {npos}{'+' if npos > count else ''} positives, header says {count}")
    if npos < count:
        raise ContainerError(f"Bloom filter has {npos} positives, fewer than the {count} values sent")


@contextlib.contextmanager
def _errors(error: type, what: str):
    """Argument errors of the kernels (ValueError, TypeError, OverflowError) as deepreduce errors."""
    try:
        yield
    except DeepReduceError:
        raise
    except (ValueError, TypeError, OverflowError) as exc:
        raise error(f"{what}: {exc}") from exc


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
                     doc="target false-positive rate; sets the block count and k"),
        "hash_seed": Param(int, default=0, low=0, high=MASK64, doc="seed of the hash family"),
    }

    # -- backend dispatch ---------------------------------------------------------------
    def _kernels(self):
        native = _native.load("bloom")
        self.backend = "c++" if native is not None else "numpy"
        return native

    def _query(self, native, p: BloomParams, payload: bytes, d: int, limit: int) -> np.ndarray:
        if native is not None:
            return native.query(payload, p.size, p.k, p.seed, d, limit, self.threads, p.family)
        return np_query(payload, p.size, p.k, p.seed, d, limit, p.family)

    def _select(self, native, p: BloomParams, P: np.ndarray, r: int) -> np.ndarray:
        policy = p.policy
        if policy in ("naive", "leftmost"):
            return P[:r]
        if policy == "rightmost":
            return P[P.size - r:]
        if policy == "middle":
            o = (P.size - r) // 2
            return P[o:o + r]
        if policy == "p1":
            if native is not None:
                return native.select_random(P, r, p.draw_seed)
            return np_select_random(P, r, p.draw_seed)
        if policy == "p2":
            if native is not None:
                return native.select_conflict(P, r, p.size, p.k, p.seed, p.draw_seed, p.family)
            return np_select_conflict(P, r, p.size, p.k, p.seed, p.draw_seed, p.family)
        return P  # p0

    # -- encode / decode ----------------------------------------------------------------
    def encode(self, indices, values, dense, ctx):
        native = self._kernels()
        d = int(dense.size)
        indices = np.asarray(indices, dtype=np.int64)
        order = np.argsort(indices, kind="stable")
        indices, values = indices[order], np.asarray(values)[order]
        r = int(indices.size)
        blocks, k = filter_params(r, self.fpr)
        draw_seed = ctx.seed_for(f"bloom-{self.policy}") if self.policy in DRAWING else 0
        p = BloomParams("blocked", self.policy, k, blocks, self.hash_seed, draw_seed)
        idx64 = indices.astype(np.uint64)
        with _errors(DeepReduceError, "Bloom encode"):
            if native is not None:
                payload = native.build(idx64, blocks, k, p.seed, self.threads)
            else:
                payload = np_build(idx64, blocks, k, p.seed)
            limit = r if self.policy in ("naive", "leftmost") else d
            P = self._query(native, p, payload, d, limit)
            chosen = self._select(native, p, P, r).astype(np.int64)
        sent = values if self.policy == "naive" else dense[chosen]
        params = pack_params(self.policy, k, blocks, p.seed, draw_seed)
        return IndexEncoding(params, payload, chosen, np.asarray(sent, dtype=np.float32))

    def decode(self, params, payload, count, numel):
        native = self._kernels()
        p = unpack_params(params)
        if len(payload) != p.filter_bytes:
            unit = f"{p.size} blocks" if p.family == "blocked" else f"m = {p.size}"
            raise ContainerError(f"Bloom section has {len(payload)} bytes, expected {p.filter_bytes} for {unit}")
        if p.family == "splitmix" and p.size % 8 and payload[-1] >> (p.size % 8):
            raise ContainerError("Bloom section has bits set beyond m")
        if p.size == 0:
            if count:
                raise ContainerError(f"empty Bloom filter cannot carry {count} indices")
            return np.zeros(0, dtype=np.int64)
        limit = count if p.policy in ("naive", "leftmost", "p0") else numel
        with _errors(ContainerError, "Bloom decode"):
            P = self._query(native, p, payload, numel, limit)
            check_positives(p.policy, P.size, count)
            return self._select(native, p, P, count).astype(np.int64)

    @classmethod
    def describe_params(cls, params: bytes) -> dict:
        p = unpack_params(params)
        out = {"family": p.family, "policy": p.policy, "k": p.k, "hash_seed": p.seed, "draw_seed": p.draw_seed}
        out.update({"blocks": p.size, "m": p.size * BLOCK_BITS} if p.family == "blocked" else {"m": p.size})
        return out
