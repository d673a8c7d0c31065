"""Elias-Fano index codec: lossless, within 2 + ceil(log2(d/r)) bits per index.

None of the papers has it; it is the yardstick a lossy Bloom codec must beat. The sorted set
``x_0 < ... < x_{r-1}`` in ``[0, d)`` is split with ``L = floor(log2(d // r))`` (0 when r = 0 or
r >= d): the low ``L`` bits of every index are packed ``L`` bits each (LSB first), then the high
parts ``x_i >> L`` as a unary bitmap of ``U = r + ((d-1) >> L)`` bits in which bit
``i + (x_i >> L)`` is set. Both parts form one LSB-first bit stream (low bits first), padded to a
byte: ``ceil((r L + U) / 8)`` bytes. ``L`` follows from ``(r, d)``, so nothing else travels.
The information limit is ``log2 C(d, r)`` bits (:func:`information_bits`).

Written against the array namespace (``deepreduce.backend.arrays``): torch tensors are encoded and
decoded on their device with the NumPy bytes.
"""
from __future__ import annotations

import math

from ..backend import arrays
from ..errors import ContainerError
from ..registry import register
from ._base import IndexCodec, IndexEncoding, sorted_pairs


def low_bits(r: int, d: int) -> int:
    """``L = floor(log2(d // r))``, the number of low bits stored verbatim."""
    return (d // r).bit_length() - 1 if 0 < r < d else 0


def stream_bits(r: int, d: int) -> int:
    """Bits of the Elias-Fano stream before byte padding: ``r L + r + ((d-1) >> L)``."""
    if r == 0:
        return 0
    L = low_bits(r, d)
    return r * L + r + ((d - 1) >> L)


def information_bits(r: int, d: int) -> float:
    """``log2 C(d, r)``: the fewest bits any lossless code needs on average for r-of-d sets."""
    return (math.lgamma(d + 1) - math.lgamma(r + 1) - math.lgamma(d - r + 1)) / math.log(2)


@register
class EliasFanoIndex(IndexCodec):
    """Elias-Fano coding of the sorted index set."""

    id = "elias_fano"
    wire_id = 6
    keeps_order = False
    array_api = True

    def encode(self, indices, values, dense, ctx):
        a, xp = arrays.adapter(dense), arrays.namespace(dense)
        indices, values = sorted_pairs(indices, values, dense)
        r, d = int(indices.shape[0]), int(dense.shape[0])
        if r == 0:
            return IndexEncoding(b"", b"", indices, values)
        L = low_bits(r, d)
        x = a.words(indices)
        upper = xp.zeros(r + ((d - 1) >> L), dtype=xp.uint8, device=dense.device)
        upper[xp.arange(r, dtype=xp.int64, device=dense.device) + a.index(a.shr(x, L))] = 1
        if L:   # entry i's low bits, LSB first: stream bits [i L, (i+1) L)
            shifts = a.words(xp.arange(L, device=dense.device))
            low = (x[:, None] >> shifts) & a.const(1)
            upper = xp.concat((xp.astype(xp.reshape(low, (-1,)), xp.uint8), upper))
        return IndexEncoding(b"", a.packbits(upper), indices, values)

    def decode(self, params, payload, count, numel):
        r, d = count, numel
        total = stream_bits(r, d)
        if params or len(payload) != (total + 7) // 8:
            raise ContainerError(f"Elias-Fano section has {len(payload)} bytes, expected {(total + 7) // 8} "
                                 f"for {r} of {d} indices")
        a = arrays.adapter(payload)
        bits = a.unpackbits(payload)
        xp = arrays.namespace(bits)
        if r == 0:
            return xp.zeros(0, dtype=xp.int64, device=bits.device)
        L = low_bits(r, d)
        if bool(xp.any(bits[total:] != 0)):
            raise ContainerError("Elias-Fano section has non-zero padding")
        ones = xp.nonzero(bits[r * L:total])[0]
        if ones.shape[0] != r:
            raise ContainerError(f"Elias-Fano upper bits hold {ones.shape[0]} entries, expected {r}")
        x = a.shl(a.words(ones - xp.arange(r, dtype=xp.int64, device=bits.device)), L)
        if L:
            shifts = a.words(xp.arange(L, device=bits.device))
            low = a.words(xp.reshape(bits[:r * L], (r, L))) << shifts
            x = x | xp.sum(low, axis=1, dtype=low.dtype)
        out = xp.astype(x, xp.int64)
        if bool(xp.any(out >= d)) or bool(xp.any(out < 0)) or (r > 1 and bool(xp.any(out[1:] <= out[:-1]))):
            raise ContainerError("Elias-Fano section decodes to indices out of range or not increasing")
        return out
