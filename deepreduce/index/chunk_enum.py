"""Enumerative chunk-local indices: each chunk's subset as its rank, ``ceil(log2 C(L, h))`` bits.

The information limit of an ``h``-subset of a chunk of ``L`` elements is ``log2 C(L, h)`` bits
(7.41 bits per index for 64 of 4,096, 8.30 for 32 of 4,096); this codec reaches it to within one
bit per chunk. The offsets ``c_1 < ... < c_h`` of a chunk are ranked in the combinatorial number
system, ``rank = sum_i C(c_i, i)``, a bijection onto ``[0, C(L, h))``, written in
``B(L, h) = bit_length(C(L, h) - 1)`` bits, LSB first, chunk after chunk in one bit stream (a
full chunk or an empty one takes 0 bits). Decoding is greedy: for ``i = h .. 1`` the largest
``c`` with ``C(c, i) <= rank``. When ``h > L / 2`` the complement (``L - h`` offsets) is ranked
instead (the same width). The binomials come from a table of ``min(h, L - h)`` rows of ``L``
Python integers per chunk length (cached); a chunk that would need more than ``TABLE_ENTRIES``
table entries (only sets far denser than a Top-k) is sent as a bitmap of ``L`` bits or as
fixed-width offsets, ``width_for(L - 1)`` bits each, whichever is smaller: every choice follows
from ``(L, h)``, which the receiver knows.

Parameters and counts as for every chunk-local codec (``deepreduce.index._chunked``): with a
``chunk_topk`` selection the section is exactly ``ceil(sum_j B(L_j, h_j) / 8)`` bytes.
A rank ``>= C(L, h)`` in a received section is refused (ContainerError), as are non-zero padding
bits and a section of the wrong length, so every accepted section decodes to one valid set.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from functools import lru_cache
from itertools import accumulate
from typing import List, Tuple

import numpy as np

from ..errors import ContainerError
from ..registry import register
from ..wire import bitpack
from ._chunked import ChunkIndexCodec

#: The most table entries (rows x chunk length) a chunk may need to be ranked (else the fallback).
TABLE_ENTRIES = 1 << 19

ENUM, BITMAP, FIXED = 0, 1, 2


@lru_cache(maxsize=64)
def layout(length: int, count: int) -> Tuple[int, int, int]:
    """``(mode, bits, ranked)`` of a chunk of ``length`` elements holding ``count`` indices:
    ``ranked`` offsets (the subset or its complement) enumerated in ``bits`` bits, or the
    fallback (bitmap, fixed-width offsets) with its bits."""
    ranked = min(count, length - count)
    if ranked * length <= TABLE_ENTRIES:
        return ENUM, (math.comb(length, count) - 1).bit_length(), ranked
    bitmap, fixed = length, count * bitpack.width_for(length - 1)
    return (BITMAP, bitmap, ranked) if bitmap <= fixed else (FIXED, fixed, ranked)


def enum_bits(length: int, count: int) -> int:
    """Bits of a chunk of ``length`` elements holding ``count`` indices (any mode)."""
    return layout(length, count)[1]


@lru_cache(maxsize=4)
def _table(length: int, rows: int) -> Tuple[List[int], ...]:
    """``table[i][c] = C(c, i)`` for ``i <= rows``, ``c < length`` (Python integers)."""
    row = [1] * length
    table = [row]
    for _ in range(rows):
        row = [0] + list(accumulate(row))[:length - 1]   # C(c, i) = sum_{j < c} C(j, i - 1)
        table.append(row)
    return tuple(table)


def _rank(offsets: np.ndarray, length: int, ranked: int) -> int:
    """The combinatorial-number-system rank of a chunk's ascending ``offsets`` (complemented when
    ``ranked`` is the complement's size)."""
    if ranked != offsets.shape[0]:
        keep = np.ones(length, dtype=bool)
        keep[offsets] = False
        offsets = np.flatnonzero(keep)
    table = _table(length, ranked)
    return sum(map(list.__getitem__, table[1:ranked + 1], offsets.tolist()))


def _unrank(rank: int, length: int, count: int, ranked: int) -> np.ndarray:
    """The ascending offsets whose rank is ``rank < C(length, count)``."""
    table = _table(length, ranked)
    out = [0] * ranked
    hi = length
    for i in range(ranked, 0, -1):
        c = bisect_right(table[i], rank, 0, hi) - 1
        rank -= table[i][c]
        out[i - 1] = hi = c
    chosen = np.asarray(out, dtype=np.int64)
    if ranked != count:
        keep = np.ones(length, dtype=bool)
        keep[chosen] = False
        chosen = np.flatnonzero(keep)
    return chosen


@register
class ChunkEnumIndex(ChunkIndexCodec):
    """Chunk-local subsets coded by their rank: the entropy bound to within a bit per chunk."""

    id = "chunk_enum"
    wire_id = 8

    def pack_chunks(self, local, counts, lengths):
        pieces, start = [], 0
        for count, length in zip(counts.tolist(), lengths.tolist()):
            offsets = local[start:start + count]
            start += count
            mode, bits, ranked = layout(length, count)
            if bits == 0:
                continue
            if mode == ENUM:
                value = _rank(offsets, length, ranked)
                raw = np.frombuffer(value.to_bytes((bits + 7) // 8, "little"), dtype=np.uint8)
                pieces.append(np.unpackbits(raw, bitorder="little")[:bits])
            elif mode == BITMAP:
                bitmap = np.zeros(length, dtype=np.uint8)
                bitmap[offsets] = 1
                pieces.append(bitmap)
            else:
                width = bitpack.width_for(length - 1)
                pieces.append(((offsets[:, None] >> np.arange(width)) & 1).astype(np.uint8).ravel())
        if not pieces:
            return b""
        return np.packbits(np.concatenate(pieces), bitorder="little").tobytes()

    def unpack_chunks(self, section, counts, lengths):
        layouts = [layout(length, count) for count, length in zip(counts.tolist(), lengths.tolist())]
        total = sum(bits for _, bits, _ in layouts)
        if len(section) != (total + 7) // 8:
            raise ContainerError(f"chunk_enum section has {len(section)} bytes, expected {(total + 7) // 8} "
                                 f"for {int(counts.sum())} indices in {counts.shape[0]} chunks")
        stream = np.unpackbits(np.frombuffer(section, dtype=np.uint8), bitorder="little")
        if bool(stream[total:].any()):
            raise ContainerError("chunk_enum section has non-zero padding")
        out, pos = [], 0
        for (mode, bits, ranked), count, length in zip(layouts, counts.tolist(), lengths.tolist()):
            piece = stream[pos:pos + bits]
            pos += bits
            if mode == ENUM:
                rank = int.from_bytes(np.packbits(piece, bitorder="little").tobytes(), "little")
                if rank >= math.comb(length, count):
                    raise ContainerError(f"chunk_enum rank of a chunk exceeds C({length}, {count})")
                out.append(_unrank(rank, length, count, ranked))
            elif mode == BITMAP:
                chosen = np.flatnonzero(piece)
                if chosen.shape[0] != count:
                    raise ContainerError(f"chunk_enum bitmap holds {chosen.shape[0]} indices, expected {count}")
                out.append(chosen)
            else:
                width = bitpack.width_for(length - 1)
                weights = np.left_shift(np.int64(1), np.arange(width, dtype=np.int64))
                out.append(piece.reshape(count, width).astype(np.int64) @ weights)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
