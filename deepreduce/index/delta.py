"""SketchML delta-binary key codecs (SketchML, Jiang et al., SIGMOD 2018, §4.2; SKCompress its extension).

``delta``: the sorted keys become gaps (the first from 0), each written little-endian in the
fewest of 1-4 bytes, with a 2-bit length flag per key (``00`` = 1 byte ... ``11`` = 4 bytes).
Payload: ``n`` u32 | flags packed 4 per byte (first key in the low bits, deepreduce.wire.bitpack) |
the gap bytes. Size ``4 + ceil(n/4) + sum(bytes)`` bytes.

``delta_huffman``: the same gaps, but the flags are Huffman coded (SKCompress codes "the prefix"
of the delta keys): the index params hold the canonical code lengths of the four flags (2 bits
each in one byte; 0 = unused) and the payload is ``n`` u32 | Huffman-coded flags
(deepreduce.wire.huffman_code, MSB first, padded to a byte) | the gap bytes.

``delta`` is written against the array namespace (``deepreduce.backend.arrays``): torch tensors are
encoded and decoded on their device with the NumPy bytes; ``delta_huffman``'s flag code is
sequential and runs on the host.

Gaps must be below 2**32 (four bytes); larger gaps only occur in tensors of more than 2**32
elements and are refused with a DeepReduceError that says so.
"""
from __future__ import annotations

import struct

import numpy as np

from ..backend import arrays
from ..errors import ContainerError, DeepReduceError
from ..registry import register
from ..wire import bitpack, huffman_code
from ._base import IndexCodec, IndexEncoding, sorted_pairs

_N = struct.Struct("<I")
_LIMITS = (1 << 8, 1 << 16, 1 << 24)


def _byte_columns(xp, like):
    """``[[0, 1, 2, 3]]``: the byte positions of a little-endian u32, as a row."""
    return xp.reshape(xp.arange(4, dtype=xp.int64, device=like.device), (1, 4))


def gaps_and_flags(indices):
    """Gaps (int64) of a sorted set (first from 0) and their byte-count flags (bytes - 1)."""
    if not arrays.is_torch(indices):
        indices = np.asarray(indices, dtype=np.int64)
    xp = arrays.namespace(indices)
    x = xp.astype(indices, xp.int64)
    gaps = xp.diff(x, prepend=xp.zeros(1, dtype=xp.int64, device=x.device)) if x.shape[0] else x
    if gaps.shape[0] and int(xp.max(gaps)) >= 1 << 32:
        raise DeepReduceError(f"delta codec: gap {int(xp.max(gaps))} needs more than 4 bytes "
                              "(tensors over 2**32 elements: use elias_fano or bloom)")
    limits = xp.asarray(_LIMITS, dtype=xp.int64, device=x.device)
    return gaps, xp.astype(xp.searchsorted(limits, gaps, side="right"), xp.int64)


def gap_bytes(gaps, flags):
    """Each gap's ``flag + 1`` low bytes, little-endian, concatenated."""
    a, xp = arrays.adapter(gaps), arrays.namespace(gaps)
    le = a.from_section(a.uint_bytes(gaps, 4), "<u1", gaps)
    keep = _byte_columns(xp, gaps) <= xp.reshape(flags, (-1, 1))
    return a.uint_bytes(xp.reshape(le, (-1, 4))[keep], 1)


def read_gaps(data, flags, count: int):
    """Inverse of :func:`gap_bytes` then prefix sum; checks length and strict increase."""
    xp = arrays.namespace(flags)
    nbytes = flags + 1
    if int(xp.sum(nbytes)) != len(data):
        raise ContainerError(f"delta key bytes: {len(data)} present, flags need {int(xp.sum(nbytes))}")
    columns = _byte_columns(xp, flags)
    le = xp.zeros((count, 4), dtype=xp.int64, device=flags.device)
    le[columns < xp.reshape(nbytes, (-1, 1))] = xp.astype(arrays.adapter(data).from_section(data, "<u1", flags),
                                                          xp.int64)
    gaps = xp.sum(le << (8 * columns), axis=1)
    if count > 1 and bool(xp.any(gaps[1:] == 0)):
        raise ContainerError("delta keys repeat an index (zero gap)")
    return xp.cumulative_sum(gaps)


def _check(indices, numel: int):
    if indices.shape[0] and int(indices[-1]) >= numel:
        raise ContainerError(f"delta keys reach {int(indices[-1])}, beyond a tensor of {numel} elements")
    return indices


@register
class DeltaIndex(IndexCodec):
    """SketchML delta-binary keys with 2-bit byte-length flags."""

    id = "delta"
    wire_id = 4
    keeps_order = False
    array_api = True

    def encode(self, indices, values, dense, ctx):
        indices, values = sorted_pairs(indices, values, dense)
        gaps, flags = gaps_and_flags(indices)
        payload = arrays.join_sections([_N.pack(indices.shape[0]), bitpack.pack(flags, 2), gap_bytes(gaps, flags)],
                                       dense)
        return IndexEncoding(b"", payload, indices, values)

    def decode(self, params, payload, count, numel):
        head = _N.size + bitpack.packed_size(count, 2)
        if params or len(payload) < head or _N.unpack_from(arrays.head_bytes(payload, _N.size))[0] != count:
            raise ContainerError(f"delta index section ({len(payload)} bytes) does not hold {count} keys")
        flags = bitpack.unpack(payload[_N.size:head], 2, count)
        xp = arrays.namespace(flags)
        flags = xp.astype(flags, xp.int64)
        if count % 4 and int(payload[head - 1]) >> (2 * (count % 4)):
            raise ContainerError("delta flags have non-zero padding")
        return _check(read_gaps(payload[head:], flags, count), numel)


@register
class DeltaHuffmanIndex(IndexCodec):
    """Delta-binary keys with Huffman-coded length flags (SKCompress)."""

    id = "delta_huffman"
    wire_id = 5
    keeps_order = False

    def encode(self, indices, values, dense, ctx):
        indices, values = sorted_pairs(indices, values, dense)
        gaps, flags = gaps_and_flags(indices)
        lengths = huffman_code.code_lengths(np.bincount(flags, minlength=4))
        params = bytes([int(sum(int(l) << (2 * s) for s, l in enumerate(lengths)))])
        payload = _N.pack(indices.shape[0]) + huffman_code.encode(flags, lengths) + gap_bytes(gaps, flags)
        return IndexEncoding(params, payload, indices, values)

    def decode(self, params, payload, count, numel):
        if len(params) != 1 or len(payload) < _N.size + count or _N.unpack_from(payload)[0] != count:
            # (every key takes at least one gap byte)
            raise ContainerError(f"delta_huffman index section ({len(payload)} bytes) does not hold {count} keys")
        lengths = np.array([(params[0] >> (2 * s)) & 3 for s in range(4)], dtype=np.int64)
        if count == 0:
            if len(payload) != _N.size:
                raise ContainerError("delta_huffman section of 0 keys has trailing bytes")
            return np.zeros(0, dtype=np.int64)
        if (lengths > 3).any():
            raise ContainerError("delta_huffman flag code table is invalid")
        flags, used = huffman_code.decode_prefix(payload[_N.size:], lengths, count)
        return _check(read_gaps(payload[_N.size + used:], flags, count), numel)


def delta_wire_bytes(indices) -> int:
    """Spec §2.5 size of the ``delta`` section: ``4 + ceil(n/4) + sum(bytes)``."""
    gaps, flags = gaps_and_flags(np.sort(np.asarray(indices, dtype=np.int64)))
    return 4 + (gaps.size + 3) // 4 + int((flags + 1).sum())
