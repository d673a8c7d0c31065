"""Static byte-level Huffman index codec (DeepReduce's Huffman baseline).

The code is a deterministic function of ``d_max``, the number of possible indices: count every
byte value over the little-endian ``w``-byte forms of all integers ``0 .. d_max-1`` (``w = 4``
when ``d_max <= 2**32``, else 8; the counts have a closed form, no table of d_max entries is
built), derive canonical Huffman code lengths with deepreduce.wire.huffman_code, and code each byte
of each index in the order given (so the codec keeps the order). ``d_max`` is the codec
parameter when set (a model's largest tensor, as in the paper), else the tensor's size; it
travels as the u64 index params. Payload: the codes, MSB first, zero padded to a byte; size
``sum of code lengths`` bits rounded up.
"""
from __future__ import annotations

import struct
from functools import lru_cache

import numpy as np

from ..errors import ContainerError
from ..params import Param
from ..registry import register
from ..wire import huffman_code
from ._base import IndexCodec, IndexEncoding

_PARAMS = struct.Struct("<Q")


def width_for(d_max: int) -> int:
    return 4 if d_max <= 1 << 32 else 8


def byte_counts(d_max: int) -> np.ndarray:
    """How often each byte value occurs in the ``w``-byte forms of ``0 .. d_max-1`` (exact ints)."""
    counts = [0] * 256
    for p in range(width_for(d_max)):
        block, period = 256 ** p, 256 ** (p + 1)
        full, rem = divmod(d_max, period)
        for v in range(256):
            counts[v] += full * block + min(max(rem - v * block, 0), block)
    return np.array(counts, dtype=object)


@lru_cache(maxsize=32)
def code_for(d_max: int) -> np.ndarray:
    """Canonical code lengths (256,) of the static code for ``d_max`` possible indices."""
    counts = byte_counts(d_max)
    # Scale exact counts into int64 range preserving order (only matters beyond ~2**55 indices).
    top = max(int(c) for c in counts)
    shift = max(0, top.bit_length() - 60)
    scaled = np.array([(int(c) >> shift) + (1 if c and not int(c) >> shift else 0) for c in counts], dtype=np.int64)
    return huffman_code.code_lengths(scaled)


def wire_bits(indices, d_max: int) -> int:
    """Spec §1.9 size in bits: the sum of the code lengths of every byte of every index."""
    w = width_for(d_max)
    data = np.asarray(indices, dtype=f"<u{w}").view(np.uint8)
    return int(code_for(d_max).astype(np.int64)[data].sum())


@register
class HuffmanIndex(IndexCodec):
    """Indices as bytes coded with a static canonical Huffman code (DeepReduce ``DR_Huffman``)."""

    id = "huffman"
    wire_id = 3
    keeps_order = True
    PARAMS = {"d_max": Param(int, default=0, low=0, high=2**64 - 1,
                             doc="number of possible indices the code is built for; 0 = the tensor's size")}

    def encode(self, indices, values, dense, ctx):
        d_max = max(self.d_max, int(dense.size))
        w = width_for(d_max)
        symbols = np.asarray(indices, dtype=f"<u{w}").view(np.uint8)
        payload = huffman_code.encode(symbols, code_for(d_max))
        return IndexEncoding(_PARAMS.pack(d_max), payload, indices, values)

    def decode(self, params, payload, count, numel):
        if len(params) != _PARAMS.size:
            raise ContainerError(f"Huffman index params have {len(params)} bytes, expected {_PARAMS.size}")
        (d_max,) = _PARAMS.unpack(params)
        if d_max < numel:
            raise ContainerError(f"Huffman code built for {d_max} indices cannot address {numel}")
        w = width_for(d_max)
        symbols = huffman_code.decode(payload, code_for(d_max), count * w)
        out = symbols.astype(np.uint8).view(f"<u{w}").astype(np.uint64)
        if count and out.max() >= np.uint64(numel):
            raise ContainerError(f"Huffman section decodes to index {int(out.max())} beyond {numel}")
        return out.astype(np.int64)
