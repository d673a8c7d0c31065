"""Canonical Huffman codes: one definition shared by every codec that Huffman-codes symbols.

NOTE for the index-codec engineer (``deepreduce/index/huffman.py``, ``delta_huffman``): this
module was written by the value-codec engineer for SketchML's Huffman-coded bucket indices
(value codec ``sketchml_huffman``). Please build the byte-level Huffman index codec on it too,
so the project has one Huffman definition; extend it additively if something is missing.

Definitions (every implementation must match them bit for bit):

* **Code lengths** from symbol counts (:func:`code_lengths`): symbols with count 0 get length 0.
  Huffman's algorithm with a min-heap ordered by ``(weight, tie)``, where a leaf's tie is its
  symbol value and the ``k``-th merged node's tie is ``alphabet_size + k``; the two popped nodes
  become children of a new node. A single used symbol gets length 1. If the longest code exceeds
  ``max_length`` (default 24), every non-zero count is halved (rounding up) and the code rebuilt,
  until it fits.
* **Canonical codes** (:func:`canonical_codes`, the DEFLATE convention): symbols sorted by
  ``(length, symbol)`` get consecutive codes; the first code of each length is
  ``(first code of the previous length + number of codes of that length) << 1``.
* **Bit stream**: each code is written most significant bit first; stream bit ``p`` is bit
  ``7 - p % 8`` of byte ``p // 8``; the last byte is zero padded.
* **Length table** (:func:`pack_lengths`): ``u32 alphabet size | u8 width w | lengths packed w
  bits each with deepreduce.wire.bitpack`` (``w = 1`` when every length is 0).

Decoding checks everything a corrupted stream can break (an over-subscribed length table, a
truncated stream, trailing bytes) and raises ContainerError.
"""
from __future__ import annotations

import heapq
import struct
from itertools import islice
from typing import Tuple

import numpy as np

from ..errors import ContainerError
from . import bitpack

DEFAULT_MAX_LENGTH = 24
_MAX_SUPPORTED = 31


def _huffman_lengths(counts: np.ndarray) -> np.ndarray:
    alphabet = counts.size
    lengths = np.zeros(alphabet, dtype=np.int64)
    used = np.flatnonzero(counts)
    if used.size == 0:
        return lengths
    if used.size == 1:
        lengths[used[0]] = 1
        return lengths
    heap = [(int(counts[s]), int(s)) for s in used]
    heapq.heapify(heap)
    parent = {}
    next_id = alphabet
    while len(heap) > 1:
        w1, a = heapq.heappop(heap)
        w2, b = heapq.heappop(heap)
        parent[a] = parent[b] = next_id
        heapq.heappush(heap, (w1 + w2, next_id))
        next_id += 1
    root = heap[0][1]
    depth = {root: 0}
    for node in range(next_id - 1, alphabet - 1, -1):  # internal nodes, parents before children
        if node != root:
            depth[node] = depth[parent[node]] + 1
    for s in used:
        lengths[s] = depth[parent[int(s)]] + 1
    return lengths


def code_lengths(counts, max_length: int = DEFAULT_MAX_LENGTH) -> np.ndarray:
    """Huffman code length of every symbol (0 for unused), at most ``max_length`` bits."""
    if not 1 <= max_length <= _MAX_SUPPORTED:
        raise ValueError(f"max_length must be in [1, {_MAX_SUPPORTED}], got {max_length}")
    counts = np.asarray(counts, dtype=np.int64).copy()
    if counts.ndim != 1 or (counts < 0).any():
        raise ValueError("counts must be a 1-D array of non-negative integers")
    if np.count_nonzero(counts) > 2 ** max_length:
        raise ValueError(f"{np.count_nonzero(counts)} symbols do not fit codes of {max_length} bits")
    while True:
        lengths = _huffman_lengths(counts)
        if lengths.max(initial=0) <= max_length:
            return lengths.astype(np.uint8)
        nz = counts > 0
        counts[nz] = (counts[nz] + 1) // 2


def _check_lengths(lengths: np.ndarray) -> None:
    """A usable table: lengths <= 31 and the Kraft sum <= 1 (== 1 unless one symbol)."""
    if lengths.size and int(lengths.max()) > _MAX_SUPPORTED:
        raise ContainerError(f"Huffman code length {int(lengths.max())} exceeds {_MAX_SUPPORTED}")
    used = lengths[lengths > 0].astype(np.int64)
    if used.size == 0:
        return
    kraft = int(np.sum(np.left_shift(1, _MAX_SUPPORTED - used)))
    full = 1 << _MAX_SUPPORTED
    if kraft > full or (used.size > 1 and kraft != full) or (used.size == 1 and used[0] != 1):
        raise ContainerError("Huffman length table does not describe a complete prefix code")


def canonical_codes(lengths) -> np.ndarray:
    """The canonical code value of each symbol (uint64; meaningless where the length is 0)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = np.zeros(lengths.size, dtype=np.uint64)
    maxlen = int(lengths.max(initial=0))
    bl_count = np.bincount(lengths, minlength=maxlen + 1)
    bl_count[0] = 0
    next_code = [0] * (maxlen + 2)
    code = 0
    for bits in range(1, maxlen + 1):
        code = (code + int(bl_count[bits - 1])) << 1
        next_code[bits] = code
    order = np.lexsort((np.arange(lengths.size), lengths))
    for s in order:
        length = int(lengths[s])
        if length:
            codes[s] = next_code[length]
            next_code[length] += 1
    return codes


def encode(symbols, lengths) -> bytes:
    """Concatenate the canonical codes of ``symbols`` (MSB first, zero padded to a byte)."""
    symbols = np.asarray(symbols, dtype=np.int64).ravel()
    lengths = np.asarray(lengths, dtype=np.int64)
    if symbols.size == 0:
        return b""
    if symbols.min() < 0 or symbols.max() >= lengths.size or (lengths[symbols] == 0).any():
        raise ValueError("a symbol has no code in this length table")
    codes = canonical_codes(lengths)
    lens = lengths[symbols]
    vals = codes[symbols]
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    total = int(lens.sum())
    bits = np.zeros(total, dtype=np.uint8)
    for b in range(int(lens.max())):
        has = lens > b
        shift = (lens[has] - 1 - b).astype(np.uint64)
        bits[starts[has] + b] = ((vals[has] >> shift) & np.uint64(1)).astype(np.uint8)
    return np.packbits(bits, bitorder="big").tobytes()


def _check_count(used_lengths: np.ndarray, count: int, nbytes: int) -> None:
    """Every symbol takes at least the shortest code length: refuse a count the bytes cannot hold
    before anything of ``count`` entries is allocated."""
    if count * int(used_lengths.min()) > 8 * nbytes:
        raise ContainerError(f"Huffman stream of {nbytes} bytes cannot hold {count} symbols "
                             f"of at least {int(used_lengths.min())} bits")


def decode(data: bytes, lengths, count: int) -> np.ndarray:
    """Decode exactly ``count`` symbols; the stream must end in the last (zero-padded) byte."""
    from bitarray import bitarray
    from bitarray.util import canonical_decode

    lengths = np.asarray(lengths, dtype=np.int64)
    _check_lengths(lengths)
    if count == 0:
        if data:
            raise ContainerError(f"Huffman stream of 0 symbols has {len(data)} bytes")
        return np.zeros(0, dtype=np.int64)
    used = np.flatnonzero(lengths)
    if used.size == 0:
        raise ContainerError("Huffman length table is empty but symbols are expected")
    _check_count(lengths[used], count, len(data))
    if used.size == 1:
        stream = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="big")
        if len(data) != (count + 7) // 8 or stream.any():
            raise ContainerError("Huffman stream of a one-symbol code is not all zero bits of the right length")
        return np.full(count, used[0], dtype=np.int64)
    maxlen = int(lengths.max())
    bl_count = np.bincount(lengths, minlength=maxlen + 1)
    bl_count[0] = 0
    order = np.lexsort((np.arange(lengths.size), lengths))
    order = order[lengths[order] > 0]
    stream = bitarray(endian="big")
    stream.frombytes(bytes(data))
    try:
        out = np.fromiter(
            islice(canonical_decode(stream, [int(c) for c in bl_count], [int(s) for s in order]), count),
            dtype=np.int64, count=count,
        )
    except ValueError as exc:
        raise ContainerError(f"Huffman stream is truncated or invalid: {exc}") from exc
    consumed = int(lengths[out].sum())
    if (consumed + 7) // 8 != len(data) or (len(data) and stream[consumed:].any()):
        raise ContainerError(f"Huffman stream has {len(data)} bytes; its {count} symbols use {consumed} bits")
    return out


def pack_lengths(lengths) -> bytes:
    """Serialise a length table: u32 alphabet size, u8 width, bit-packed lengths."""
    lengths = np.asarray(lengths, dtype=np.int64)
    width = bitpack.width_for(int(lengths.max(initial=0)))
    return struct.pack("<IB", lengths.size, width) + bitpack.pack(lengths, width)


def unpack_lengths(buf: bytes, offset: int = 0, max_alphabet: int = 1 << 24) -> Tuple[np.ndarray, int]:
    """Inverse of :func:`pack_lengths`: (lengths, offset after the table)."""
    if len(buf) - offset < 5:
        raise ContainerError("Huffman length table is truncated")
    alphabet, width = struct.unpack_from("<IB", buf, offset)
    if alphabet > max_alphabet or not 1 <= width <= 5:
        raise ContainerError(f"Huffman length table invalid: alphabet {alphabet}, width {width}")
    offset += 5
    size = bitpack.packed_size(alphabet, width)
    if len(buf) - offset < size:
        raise ContainerError("Huffman length table is truncated")
    lengths = bitpack.unpack(buf[offset:offset + size], width, alphabet).astype(np.int64)
    _check_lengths(lengths)
    return lengths, offset + size


def decode_prefix(data: bytes, lengths, count: int) -> Tuple[np.ndarray, int]:
    """Decode ``count`` symbols from the start of ``data``, which may go on with other bytes.

    Returns the symbols and the number of bytes their zero-padded code occupies. (Added for
    the ``delta_huffman`` index codec, whose flag stream is followed by the key bytes.)
    """
    from bitarray import bitarray
    from bitarray.util import canonical_decode

    lengths = np.asarray(lengths, dtype=np.int64)
    _check_lengths(lengths)
    if count == 0:
        return np.zeros(0, dtype=np.int64), 0
    used = np.flatnonzero(lengths)
    if used.size == 0:
        raise ContainerError("Huffman length table is empty but symbols are expected")
    _check_count(lengths[used], count, len(data))
    stream = bitarray(endian="big")
    stream.frombytes(bytes(data))
    if used.size == 1:
        out = np.full(count, used[0], dtype=np.int64)
    else:
        maxlen = int(lengths.max())
        bl_count = np.bincount(lengths, minlength=maxlen + 1)
        bl_count[0] = 0
        order = np.lexsort((np.arange(lengths.size), lengths))
        order = order[lengths[order] > 0]
        try:
            out = np.fromiter(
                islice(canonical_decode(stream, [int(c) for c in bl_count], [int(s) for s in order]), count),
                dtype=np.int64, count=count,
            )
        except ValueError as exc:
            raise ContainerError(f"Huffman stream is truncated or invalid: {exc}") from exc
    consumed = int(lengths[out].sum())
    nbytes = (consumed + 7) // 8
    if nbytes > len(data) or (used.size == 1 and stream[:consumed].any()) or stream[consumed:8 * nbytes].any():
        raise ContainerError(f"Huffman stream of {count} symbols is truncated or has non-zero padding")
    return out, nbytes
