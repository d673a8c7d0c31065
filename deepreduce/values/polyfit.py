"""Fit-Poly: piece-wise polynomial least squares on the sorted values (DeepReduce §5).

Encode (spec §1.10, readings III.10-12):

1. sort the values descending by signed value (stable; ``_sorting.sort_descending``); the
   permutation goes back to the pipeline as ``ValueEncoding.order``;
2. split at ``l`` = number of values ``>= 0`` (zeros join the positive part);
3. per part, greedy chord segmentation: a segment's split point is the first interior point of
   largest squared distance to the chord through its end points, moved inside the segment so
   both children keep at least ``max(degree + 1, min_points)`` points; the segment with the
   largest distance is split next, until ``segments`` pieces exist per sign (0: automatic,
   :func:`auto_segments` of ``n``) or nothing can split;
4. per segment of ``L`` points, least squares of degree ``min(degree, L - 1)`` in the Legendre
   basis on the scaled abscissa ``t_i = i h - 1``, ``h = 2 / (L - 1)`` (``t = 0`` when ``L = 1``): normal
   equations (the Legendre Gram matrix on [-1, 1] is nearly diagonal, so this is well
   conditioned) solved by Cholesky, all in float64; coefficients sent as float32 (default) or
   float64.

Wire: params ``u8 degree | u8 coefficient bytes (4 or 8)``; payload ``u32 l | u32 segment
lengths (positive part until they sum to l, then negative part until they sum to n) |
coefficients``. For full segments that is ``32 + 32 n_seg + n_seg (degree + 1) w_c`` bits, the
formula of spec §1.16.

The C++ kernel (``csrc/fit``, module ``deepreduce._fit``, also the params rule and the decode
checks with this module's error texts) and the NumPy path below perform the
same float64 operations in the same order (sequential sums via ``cumsum``, the same recurrence,
the same Cholesky), so they produce identical payloads; decode uses only + * / and is therefore
bit-reproducible on every IEEE-754 machine.
"""
from __future__ import annotations

import math
import struct

import numpy as np

from ..backend import _native
from ..errors import ContainerError, DeepReduceError
from ..params import Param
from ..registry import register
from ._base import ValueCodec, ValueEncoding, in_input_order
from ._sorting import sort_descending

MAX_DEGREE = 15
COEF_DTYPES = {"float32": 4, "float64": 8}
_COEF_NP = {4: np.dtype("<f4"), 8: np.dtype("<f8")}


def abscissa(length: int) -> np.ndarray:
    """The scaled abscissae ``t_i = i h - 1``, ``h = 2 / (length - 1)``, of a segment: [-1, 1]."""
    if length <= 1:
        return np.zeros(max(length, 0), dtype=np.float64)
    return np.arange(length, dtype=np.float64) * (2.0 / float(length - 1)) - 1.0


_REC_A = [(2.0 * k + 1.0) / (k + 1.0) for k in range(MAX_DEGREE + 1)]
_REC_B = [float(k) / (k + 1.0) for k in range(MAX_DEGREE + 1)]


def legendre_rows(t: np.ndarray, degree: int) -> list:
    """``[P_0(t), ..., P_degree(t)]`` by ``P_{k+1} = A_k t P_k - B_k P_{k-1}`` (as fit.cpp)."""
    rows = [np.ones_like(t)]
    if degree >= 1:
        rows.append(t.copy())
    for k in range(1, degree):
        rows.append(_REC_A[k] * t * rows[k] - _REC_B[k] * rows[k - 1])
    return rows


def _seq_sum(x: np.ndarray) -> float:
    """Left-to-right float64 sum (the summation order of the C++ kernel)."""
    return float(np.cumsum(x)[-1]) if x.size else 0.0


def fit_segment(y: np.ndarray, degree: int) -> np.ndarray:
    """Legendre least-squares coefficients of ``y`` (float64) for degree ``degree``."""
    m = degree + 1
    rows = legendre_rows(abscissa(y.size), degree)
    gram = [[0.0] * m for _ in range(m)]
    rhs = [0.0] * m
    for j in range(m):
        for k in range(j + 1):
            gram[j][k] = _seq_sum(rows[j] * rows[k])
        rhs[j] = _seq_sum(rows[j] * y)
    low = [[0.0] * m for _ in range(m)]
    for j in range(m):
        s = gram[j][j]
        for q in range(j):
            s -= low[j][q] * low[j][q]
        if not s > 0.0:
            raise DeepReduceError("polyfit: normal equations are not positive definite")
        low[j][j] = math.sqrt(s)
        for i in range(j + 1, m):
            t = gram[i][j]
            for q in range(j):
                t -= low[i][q] * low[j][q]
            low[i][j] = t / low[j][j]
    z = [0.0] * m
    for j in range(m):
        s = rhs[j]
        for q in range(j):
            s -= low[j][q] * z[q]
        z[j] = s / low[j][j]
    coef = [0.0] * m
    for j in range(m - 1, -1, -1):
        s = z[j]
        for q in range(j + 1, m):
            s -= low[q][j] * coef[q]
        coef[j] = s / low[j][j]
    out = np.array(coef, dtype=np.float64)
    if not np.isfinite(out).all():
        raise DeepReduceError("polyfit: a fitted coefficient is not finite")
    return out


def evaluate_segment(coef: np.ndarray, length: int) -> np.ndarray:
    """The fitted curve of one segment at its abscissae (float64)."""
    rows = legendre_rows(abscissa(length), coef.size - 1)
    acc = coef[0] * rows[0]
    for j in range(1, coef.size):
        acc = acc + coef[j] * rows[j]
    return acc


def _chord_split(y: np.ndarray, a: int, b: int, min_points: int):
    """(largest squared chord distance, split point) of segment [a, b), or (-1, -1).

    The split point is the first argmax, moved inside ``[a + min_points, b - min_points]`` so
    both children keep ``min_points`` points; a segment shorter than ``2 min_points`` or
    exactly a line is final (as ``chord_split`` in fit.cpp).
    """
    if b - a < 3 or b - a < 2 * min_points:
        return -1.0, -1
    ya = y[a]
    slope = (y[b - 1] - ya) / float(b - 1 - a)
    idx = np.arange(a + 1, b - 1)
    dist = np.square(ya + slope * (idx - a).astype(np.float64) - y[a + 1:b - 1])
    arg = int(np.argmax(dist))
    if not dist[arg] > 0.0:
        return -1.0, -1
    split = min(max(a + 1 + arg, a + min_points), b - min_points)
    return float(dist[arg]), split


def segment_part(y: np.ndarray, a: int, b: int, max_segments: int, min_points: int) -> list:
    """Greedy chord segmentation of ``y[a:b]``; returns the segment lengths in order."""
    if b <= a:
        return []
    segs = [(a, b) + _chord_split(y, a, b, min_points)]
    while len(segs) < max_segments:
        pick, best = -1, -1.0
        for k, (_, _, dist, split) in enumerate(segs):
            if split >= 0 and dist > best:
                pick, best = k, dist
        if pick < 0:
            break
        sa, sb, _, split = segs[pick]
        segs[pick:pick + 1] = [(sa, split) + _chord_split(y, sa, split, min_points),
                               (split, sb) + _chord_split(y, split, sb, min_points)]
    return [sb - sa for sa, sb, _, _ in segs]


AUTO_SEGMENTS_MIN = 4
AUTO_SEGMENTS_BASE = 1000
AUTO_VALUES_PER_SEGMENT = 64


def auto_segments(n: int) -> int:
    """Segments per sign when the config says 0 (``deepreduce::fit::auto_segments``).

    4, plus one per doubling of ``n`` beyond 1,000 values, so the error keeps falling as ``n``
    grows (12 at 255,570 values, 1% of ResNet-50) while the value section stays a few hundred
    bytes (``32 + 32 s + w_c s (degree + 1)`` bits for ``s`` full segments); at most
    ``n // 64`` (at least 1), so a small ``n`` is never covered by segments whose coefficients
    outweigh their values.
    """
    extra = 0
    while extra < 40 and (AUTO_SEGMENTS_BASE << extra) < n:
        extra += 1
    return min(AUTO_SEGMENTS_MIN + extra, max(1, n // AUTO_VALUES_PER_SEGMENT))


def seg_degree(length: int, degree: int) -> int:
    return min(degree, length - 1)


def encode_numpy(values: np.ndarray, degree: int, max_segments: int, min_points: int, coef_bytes: int):
    """NumPy twin of ``deepreduce::fit::encode``: (permutation, payload)."""
    perm = sort_descending(values)
    y = values[perm].astype(np.float64)
    n = y.size
    l = int(np.count_nonzero(y >= 0.0))
    max_segments = max_segments or auto_segments(n)
    minp = max(min_points, degree + 1)
    lengths = segment_part(y, 0, l, max_segments, minp) + segment_part(y, l, n, max_segments, minp)
    coefs, start = [], 0
    for length in lengths:
        coef = fit_segment(y[start:start + length], seg_degree(length, degree))
        cast = coef.astype(_COEF_NP[coef_bytes])
        if not np.isfinite(cast).all():
            raise DeepReduceError("polyfit: a coefficient overflows the coefficient type")
        coefs.append(cast.tobytes())
        start += length
    head = struct.pack(f"<I{len(lengths)}I", l, *lengths)
    return perm, head + b"".join(coefs)


# The params rule has one C++ definition (csrc/fit, the one the TensorFlow ops run), called through
# deepreduce._fit when it is built; the *_python functions are the fallback (tests compare them).
def pack_params(degree: int, coef_bytes: int) -> bytes:
    """``u8 degree | u8 coefficient bytes``."""
    native = _native.load("fit")
    return native.pack_params(degree, coef_bytes) if native is not None else pack_params_python(degree, coef_bytes)


def pack_params_python(degree: int, coef_bytes: int) -> bytes:
    """:func:`pack_params` without the extension."""
    return struct.pack("<BB", degree, coef_bytes)


def unpack_params(params: bytes) -> tuple:
    """``(degree, coef_bytes)`` of checked params; ContainerError names what is wrong."""
    native = _native.load("fit")
    if native is None:
        return unpack_params_python(params)
    try:
        return native.unpack_params(bytes(params))
    except ValueError as exc:
        raise ContainerError(str(exc)) from None


def unpack_params_python(params: bytes) -> tuple:
    """:func:`unpack_params` without the extension."""
    if len(params) != 2:
        raise ContainerError(f"polyfit parameters have {len(params)} bytes, expected 2")
    degree, coef_bytes = struct.unpack("<BB", params)
    if degree > MAX_DEGREE or coef_bytes not in _COEF_NP:
        raise ContainerError(f"polyfit parameters invalid: degree {degree}, coefficient bytes {coef_bytes}")
    return degree, coef_bytes


def parse_lengths(payload: bytes, count: int, degree: int):
    """Segment lengths of a payload and where its coefficients start; ContainerError if bad."""
    if len(payload) < 4:
        raise ContainerError(f"polyfit value section has {len(payload)} bytes; at least 4 expected")
    (l,) = struct.unpack_from("<I", payload)
    if l > count:
        raise ContainerError(f"polyfit value section claims {l} non-negative values of {count}")
    pos, lengths, ncoef = 4, [], 0
    for total in (l, count - l):
        acc = 0
        while acc < total:
            if pos + 4 > len(payload):
                raise ContainerError("polyfit value section ends inside its segment table")
            (s,) = struct.unpack_from("<I", payload, pos)
            pos += 4
            if s == 0 or s > total - acc:
                raise ContainerError("polyfit segment lengths do not add up to the value count")
            acc += s
            lengths.append(s)
            ncoef += seg_degree(s, degree) + 1
    return lengths, pos, ncoef


def decode_numpy(payload: bytes, count: int, degree: int, coef_bytes: int) -> np.ndarray:
    """NumPy twin of ``deepreduce::fit::decode``: the values in sorted order (float32)."""
    lengths, pos, ncoef = parse_lengths(payload, count, degree)
    if len(payload) - pos != ncoef * coef_bytes:
        raise ContainerError(
            f"polyfit value section has {len(payload)} bytes, its segment table implies {pos + ncoef * coef_bytes}"
        )
    coefs = np.frombuffer(payload, dtype=_COEF_NP[coef_bytes], offset=pos, count=ncoef).astype(np.float64)
    if not np.isfinite(coefs).all():
        raise ContainerError("polyfit value section holds a non-finite coefficient")
    out, k = [], 0
    for length in lengths:
        m = seg_degree(length, degree) + 1
        out.append(evaluate_segment(coefs[k:k + m], length))
        k += m
    with np.errstate(over="ignore"):
        result = np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)
    if not np.isfinite(result).all():
        raise ContainerError("polyfit value section decodes to non-finite values")
    return result


@register
class PolyFit(ValueCodec):
    """Fit-Poly: sorted values as piece-wise degree-``degree`` polynomials (reorders values)."""

    id = "polyfit"
    wire_id = 2
    keeps_order = False
    PARAMS = {
        "degree": Param(int, default=5, low=0, high=MAX_DEGREE, doc="polynomial degree n'"),
        "segments": Param(int, default=0, low=0, high=65535,
                          doc="most segments per sign; 0: automatic (auto_segments: 4 + ceil(log2(n / 1000)), "
                              "at most n // 64)"),
        "min_points": Param(int, default=6, low=1, high=2**31 - 1,
                            doc="fewest points per segment (at least degree+1; a segment length is at most "
                                "2**31 - 1 in the C++ kernel)"),
        "coef_dtype": Param(str, default="float32", choices=tuple(COEF_DTYPES), doc="coefficient precision"),
    }

    @property
    def _native(self):
        """The C++ kernel, or None (NumPy path); looked up per call so the instance stays picklable."""
        return _native.load("fit")

    @property
    def backend(self) -> str:
        return "c++" if self._native is not None else "numpy"

    @property
    def coef_bytes(self) -> int:
        return COEF_DTYPES[self.coef_dtype]

    def encode(self, values, ctx):
        values = np.ascontiguousarray(values, dtype=np.float32)
        native = self._native
        if native is not None:
            try:
                perm, payload = native.encode(values, self.degree, self.segments,
                                                    self.min_points, self.coef_bytes)
            except ValueError as exc:
                raise DeepReduceError(f"polyfit encode of tensor {ctx.name!r} failed: {exc}") from exc
        else:
            perm, payload = encode_numpy(values, self.degree, self.segments, self.min_points, self.coef_bytes)
        params = pack_params(self.degree, self.coef_bytes)
        try:  # the receiver's values: the fitted curves at the n sorted positions
            curve = self.decode(params, payload, values.size)
        except ContainerError as exc:
            raise DeepReduceError(f"polyfit: the fit of tensor {ctx.name!r} does not decode: {exc}") from exc
        return ValueEncoding(params, payload, perm, in_input_order(curve, perm))

    def decode(self, params, payload, count):
        degree, coef_bytes = unpack_params(params)
        native = self._native
        if native is not None:   # checks the segment table before n values are allocated
            try:
                return native.decode(bytes(payload), count, degree, coef_bytes)
            except ValueError as exc:
                raise ContainerError(str(exc)) from None
        return decode_numpy(bytes(payload), count, degree, coef_bytes)

    @classmethod
    def describe_params(cls, params):
        degree, coef_bytes = unpack_params(params)
        return {"degree": degree, "coef_dtype": "float32" if coef_bytes == 4 else "float64"}
