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

This module is the definition (:func:`pack_chunks_python`, :func:`unpack_chunks_python`). When the
C++ extension ``deepreduce._chunk_enum`` (csrc/chunk_enum) is built, the codec runs it instead: the
same bits and the same refusals with the same texts (tests/test_chunk_enum_native.py), ranks as
fixed-width integers of 64-bit limbs, chunks split over the codec's ``threads``, at a half to a
third of this module's CPU per index (docs/chunked.md).
"""
from __future__ import annotations

import math
from bisect import bisect_right
from functools import lru_cache
from itertools import accumulate
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..backend import _native
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


#: Cached binomial tables, ``(length, rows) -> (exact rows, float64 rows)`` (exact: object arrays of
#: Python integers, indexed by a whole column of chunks at once); a table serves every
#: request it covers (``C(c, i)`` does not depend on the chunk length), so the tails of many
#: tensors reuse the full chunks' table.
_TABLES: Dict[Tuple[int, int], Tuple[Tuple[np.ndarray, ...], Optional[Tuple[np.ndarray, ...]]]] = {}
_TABLES_KEPT = 3


def _tables(length: int, rows: int):
    """``(table, floats)``: ``table[i][c] = C(c, i)`` for ``i <= rows``, ``c < length`` at least
    (object arrays of Python integers), and the same as float64 arrays (a first guess for the greedy decode; only
    used when the ranks fit a float)."""
    for (have_length, have_rows), tables in _TABLES.items():
        if have_length >= length and have_rows >= rows:
            return tables
    row = [1] * length
    table = [row]
    for _ in range(rows):
        row = [0] + list(accumulate(row))[:length - 1]   # C(c, i) = sum_{j < c} C(j, i - 1)
        table.append(row)
    fits = (math.comb(length, rows) - 1).bit_length() < 1000 if rows <= length else False
    floats = tuple(np.asarray([float(v) for v in r], dtype=np.float64) for r in table) if fits else None
    while len(_TABLES) >= _TABLES_KEPT:
        del _TABLES[next(iter(_TABLES))]
    _TABLES[(length, rows)] = (tuple(np.array(r, dtype=object) for r in table), floats)
    return _TABLES[(length, rows)]


def _complement(offsets: np.ndarray, length: int) -> np.ndarray:
    """Per row of ``offsets`` (g x h, ascending), the ascending offsets of ``[0, length)`` not in it."""
    keep = np.ones((offsets.shape[0], length), dtype=bool)
    keep[np.arange(offsets.shape[0])[:, None], offsets] = False
    return np.nonzero(keep)[1].reshape(offsets.shape[0], length - offsets.shape[1])


def _ranks(offsets: np.ndarray, length: int, ranked: int) -> List[int]:
    """The combinatorial-number-system rank of every row of ``offsets`` (g x h, ascending in a
    row), of its complement when ``ranked`` is the complement's size."""
    if ranked != offsets.shape[1]:
        offsets = _complement(offsets, length)
    table = _tables(length, ranked)[0]
    total = np.zeros(offsets.shape[0], dtype=object)   # Python integers: a column of terms per bit position
    for i in range(1, ranked + 1):
        total = total + table[i][offsets[:, i - 1]]
    return [int(r) for r in total]


def _unrank(ranks: List[int], length: int, count: int, ranked: int) -> np.ndarray:
    """The g x ``count`` ascending offsets whose ranks are ``ranks`` (each ``< C(length, count)``).

    Greedy, all chunks of a run at once: for ``i = ranked .. 1``, the largest ``c`` below the
    previous one with ``C(c, i) <= rank``, guessed from a float64 table with ``searchsorted``
    (when the ranks fit a float) and settled with the exact integers, every chunk in one NumPy
    operation on an object array of Python integers, not a Python loop per chunk (docs/chunked.md
    has the figures)."""
    g = len(ranks)
    table, floats = _tables(length, ranked)
    if (math.comb(length, ranked) - 1).bit_length() >= 1000:
        floats = None
    out = np.empty((g, ranked), dtype=np.int64)
    left = np.empty(g, dtype=object)   # Python integers, compared and subtracted a chunk per element
    left[:] = list(ranks)
    hi = np.full(g, length, dtype=np.int64)
    for i in range(ranked, 0, -1):
        row = table[i]   # C(c, i) for c < length at least
        if floats is not None:
            guess = np.searchsorted(floats[i], left.astype(np.float64), side="right") - 1
        else:
            guess = np.asarray([bisect_right(row, r, 0, int(h)) - 1 for r, h in zip(left, hi)], dtype=np.int64)
        c = np.clip(np.minimum(guess, hi - 1), 0, None)
        while True:   # up: the largest c below hi with C(c, i) <= rank (the float guess may be low)
            up = (c + 1 < hi) & (row[np.minimum(c + 1, len(row) - 1)] <= left)
            if not up.any():
                break
            c = c + up
        while True:   # down: the float guess may be high
            down = row[c] > left
            if not down.any():
                break
            c = c - down
        left = left - row[c]
        hi = c
        out[:, i - 1] = hi
    if ranked != count:
        out = _complement(out, length)
    return out


def _runs(counts: np.ndarray, lengths: np.ndarray):
    """``(count, length, chunks)`` for every run of consecutive chunks with equal count and length."""
    if counts.shape[0] == 0:
        return
    change = np.flatnonzero((counts[1:] != counts[:-1]) | (lengths[1:] != lengths[:-1])) + 1
    edges = [0] + change.tolist() + [counts.shape[0]]
    for a, b in zip(edges, edges[1:]):
        yield int(counts[a]), int(lengths[a]), b - a


def pack_chunks_python(local: np.ndarray, counts: np.ndarray, lengths: np.ndarray) -> bytes:
    """The section of the chunk-local ``local`` offsets (the definition; see the module docstring);
    ValueError naming the first chunk whose offsets are not strictly ascending inside it (a
    selection with a repeated position: a multiset has no rank)."""
    pieces, start, first = [], 0, 0
    for count, length, chunks in _runs(counts, lengths):
        offsets = local[start:start + count * chunks].reshape(chunks, count)
        start += count * chunks
        bad = np.flatnonzero((offsets[:, 0] < 0) | (offsets[:, -1] >= length)
                             | np.any(offsets[:, 1:] <= offsets[:, :-1], axis=1)) if count else ()
        if len(bad):   # a multiset or an offset past its chunk has no rank: refused, as csrc/chunk_enum does
            raise ValueError(f"chunk_enum: the offsets of chunk {first + int(bad[0])} are not ascending within "
                             f"[0, {length})")
        first += chunks
        mode, bits, ranked = layout(length, count)
        if bits == 0:
            continue
        if mode == ENUM:
            size = (bits + 7) // 8
            blob = b"".join(r.to_bytes(size, "little") for r in _ranks(offsets, length, ranked))
            raw = np.frombuffer(blob, dtype=np.uint8).reshape(chunks, size)
            pieces.append(np.unpackbits(raw, axis=1, bitorder="little")[:, :bits].ravel())
        elif mode == BITMAP:
            bitmap = np.zeros((chunks, length), dtype=np.uint8)
            bitmap[np.arange(chunks)[:, None], offsets] = 1
            pieces.append(bitmap.ravel())
        else:
            width = bitpack.width_for(length - 1)
            pieces.append(((offsets.reshape(-1, 1) >> np.arange(width)) & 1).astype(np.uint8).ravel())
    if not pieces:
        return b""
    return np.packbits(np.concatenate(pieces), bitorder="little").tobytes()


def unpack_chunks_python(section: bytes, counts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The int64 chunk-local offsets of a section, or ContainerError (the definition)."""
    runs = list(_runs(counts, lengths))
    total = sum(layout(length, count)[1] * chunks for count, length, chunks in runs)
    if len(section) != (total + 7) // 8:
        raise ContainerError(f"chunk_enum section has {len(section)} bytes, expected {(total + 7) // 8} "
                             f"for {int(counts.sum())} indices in {counts.shape[0]} chunks")
    stream = np.unpackbits(np.frombuffer(section, dtype=np.uint8), bitorder="little")
    if bool(stream[total:].any()):
        raise ContainerError("chunk_enum section has non-zero padding")
    out, pos = [], 0
    for count, length, chunks in runs:
        mode, bits, ranked = layout(length, count)
        piece = stream[pos:pos + bits * chunks].reshape(chunks, bits)
        pos += bits * chunks
        if mode == ENUM:
            size = (bits + 7) // 8
            padded = np.zeros((chunks, 8 * size), dtype=np.uint8)
            padded[:, :bits] = piece
            blob = np.packbits(padded, axis=1, bitorder="little").tobytes()
            ranks = [int.from_bytes(blob[j * size:(j + 1) * size], "little") for j in range(chunks)]
            if max(ranks) >= math.comb(length, count):
                raise ContainerError(f"chunk_enum rank of a chunk exceeds C({length}, {count})")
            out.append(_unrank(ranks, length, count, ranked).ravel())
        elif mode == BITMAP:
            held = piece.sum(axis=1)
            if bool(np.any(held != count)):
                raise ContainerError(f"chunk_enum bitmap holds {int(held[held != count][0])} indices, "
                                     f"expected {count}")
            out.append(np.nonzero(piece)[1])
        else:
            width = bitpack.width_for(length - 1)
            weights = np.left_shift(np.int64(1), np.arange(width, dtype=np.int64))
            out.append(piece.reshape(chunks * count, width).astype(np.int64) @ weights)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


@register
class ChunkEnumIndex(ChunkIndexCodec):
    """Chunk-local subsets coded by their rank: the entropy bound to within a bit per chunk."""

    id = "chunk_enum"
    wire_id = 8

    def pack_chunks(self, local, counts, lengths):
        native = _native.load("chunk_enum")
        if native is None:
            return pack_chunks_python(local, counts, lengths)
        return native.pack(local, counts, lengths, TABLE_ENTRIES, self.threads)

    def unpack_chunks(self, section, counts, lengths):
        native = _native.load("chunk_enum")
        if native is None:
            return unpack_chunks_python(section, counts, lengths)
        try:
            return native.unpack(section, counts, lengths, TABLE_ENTRIES, self.threads)
        except ValueError as exc:   # ErrorKind::CONTAINER, with the texts of unpack_chunks_python
            raise ContainerError(str(exc)) from None
