"""Elias-Fano index codec: lossless, within 2 + ceil(log2(d/r)) bits per index.

None of the papers has it; it is the yardstick a lossy Bloom codec must beat. The sorted set
``x_0 < ... < x_{r-1}`` in ``[0, d)`` is split with ``L = floor(log2(d // r))`` (0 when r = 0 or
r >= d): the low ``L`` bits of every index are packed ``L`` bits each (LSB first), then the high
parts ``x_i >> L`` as a unary bitmap of ``U = r + ((d-1) >> L)`` bits in which bit
``i + (x_i >> L)`` is set. Both parts form one LSB-first bit stream (low bits first), padded to a
byte: ``ceil((r L + U) / 8)`` bytes. ``L`` follows from ``(r, d)``, so nothing else travels.
The information limit is ``log2 C(d, r)`` bits (:func:`information_bits`).
"""
from __future__ import annotations

import math

import numpy as np

from .. import bitpack
from ..errors import ContainerError
from ..registry import register
from ._base import IndexCodec, IndexEncoding


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

    def encode(self, indices, values, dense, ctx):
        order = np.argsort(indices, kind="stable")
        indices, values = np.asarray(indices, dtype=np.int64)[order], np.asarray(values)[order]
        r, d = int(indices.size), int(dense.size)
        if r == 0:
            return IndexEncoding(b"", b"", indices, values)
        L = low_bits(r, d)
        x = indices.astype(np.uint64)
        upper = np.zeros(r + ((d - 1) >> L), dtype=np.uint8)
        upper[np.arange(r, dtype=np.int64) + (x >> np.uint64(L)).astype(np.int64)] = 1
        if L:
            low = np.unpackbits(np.frombuffer(bitpack.pack(x & np.uint64((1 << L) - 1), L), np.uint8),
                                bitorder="little", count=r * L)
            upper = np.concatenate((low, upper))
        return IndexEncoding(b"", np.packbits(upper, bitorder="little").tobytes(), indices, values)

    def decode(self, params, payload, count, numel):
        r, d = count, numel
        total = stream_bits(r, d)
        if params or len(payload) != (total + 7) // 8:
            raise ContainerError(f"Elias-Fano section has {len(payload)} bytes, expected {(total + 7) // 8} "
                                 f"for {r} of {d} indices")
        if r == 0:
            return np.zeros(0, dtype=np.int64)
        L = low_bits(r, d)
        bits = np.unpackbits(np.frombuffer(payload, dtype=np.uint8), bitorder="little")
        if bits[total:].any():
            raise ContainerError("Elias-Fano section has non-zero padding")
        ones = np.flatnonzero(bits[r * L:total])
        if ones.size != r:
            raise ContainerError(f"Elias-Fano upper bits hold {ones.size} entries, expected {r}")
        high = (ones - np.arange(r)).astype(np.uint64)
        x = high << np.uint64(L)
        if L:
            x |= bitpack.unpack(np.packbits(bits[:r * L], bitorder="little").tobytes(), L, r)
        out = x.astype(np.int64)
        if (x >= np.uint64(d)).any() or (r > 1 and (np.diff(out) <= 0).any()):
            raise ContainerError("Elias-Fano section decodes to indices out of range or not increasing")
        return out
