"""Chunk geometry shared by the chunked Top-k sparsifier and the chunk-local index codecs.

A flat tensor of ``d`` elements is cut into ``m = d // C`` full chunks of ``C`` consecutive
elements and, when ``t = d - m C > 0``, one tail chunk of ``t`` elements (a tensor smaller than
``C`` is a single tail chunk; 1-D tensors are chunked like any other). The sparsifier
``chunk_topk`` keeps ``k`` entries of every full chunk and :func:`tail_count` ``= ceil(k t / C)``
(at least 1, at most ``t``) of the tail, so the number of kept entries, and with it every
container of a tensor, depends only on ``(d, C, k)``.

The chunk-local index codecs (``chunk_fixed``, ``chunk_enum``) encode a set of positions chunk
by chunk. Their parameter bytes say how the receiver learns the count of every chunk:

* ``varint C | varint k`` with ``k >= 1`` (*uniform*): the counts follow from ``(d, C, k)`` by
  the rule above; the receiver checks that the container's ``n`` equals :func:`uniform_total`.
* ``varint C | varint 0`` (*counted*): any other set (another sparsifier's selection, a shard of
  the sparse all-reduce, an owner's re-selection); the section starts with the count of every
  chunk at ``width_for(C)`` bits.
* empty, when ``n = 0``.

``C`` is at most :data:`MAX_CHUNK` (a receiver's work per chunk stays bounded).
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

from ..errors import ContainerError
from . import bitpack, varint

MAX_CHUNK = 1 << 20


def tail_count(k: int, tail: int, chunk: int) -> int:
    """Entries kept in a tail chunk of ``tail`` elements: ``ceil(k tail / C)``, in ``[1, tail]``
    (0 without a tail)."""
    if tail <= 0:
        return 0
    return max(1, min(tail, (k * tail + chunk - 1) // chunk))


def lengths(numel: int, chunk: int) -> Tuple[int, int]:
    """``(m, t)``: the number of full chunks and the tail's length."""
    return numel // chunk, numel % chunk


def chunk_count(numel: int, chunk: int) -> int:
    """Chunks of a tensor, the tail included."""
    return -(-numel // chunk)


def uniform_counts(numel: int, chunk: int, k: int) -> np.ndarray:
    """The per-chunk counts of a ``chunk_topk`` selection (int64, one per chunk)."""
    m, t = lengths(numel, chunk)
    counts = np.full(m + (1 if t else 0), min(k, chunk), dtype=np.int64)
    if t:
        counts[-1] = tail_count(min(k, chunk), t, chunk)
    return counts


def uniform_total(numel: int, chunk: int, k: int) -> int:
    """Entries a ``chunk_topk`` selection keeps: ``m k + tail_count(k, t, C)``."""
    m, t = lengths(numel, chunk)
    return m * min(k, chunk) + tail_count(min(k, chunk), t, chunk)


def counts_of(indices: np.ndarray, numel: int, chunk: int) -> np.ndarray:
    """How many of the (ascending, in-range) ``indices`` fall in each chunk (int64)."""
    return np.bincount(np.asarray(indices, dtype=np.int64) // chunk,
                       minlength=chunk_count(numel, chunk)).astype(np.int64)


def uniform_k(counts: np.ndarray, numel: int, chunk: int) -> int:
    """The ``k`` whose ``chunk_topk`` counts equal ``counts`` (one per chunk of ``chunk <= numel``
    elements), or 0 when none does."""
    if counts.shape[0] == 0 or numel < chunk:
        return 0
    k = int(counts[0])
    if k < 1 or not np.array_equal(counts, uniform_counts(numel, chunk, k)):
        return 0
    return k


def write_params(chunk: int, k: int) -> bytes:
    """The geometry parameter bytes (``k = 0``: counts travel in the section)."""
    return varint.encode(chunk) + varint.encode(k)


def read_params(codec: str, params: bytes, count: int, numel: int) -> Tuple[int, int]:
    """``(C, k)`` from parameter bytes, checked against the container's ``n`` and ``numel``;
    ContainerError names ``codec`` and the problem."""
    chunk, pos = varint.decode(params, 0, f"{codec} chunk")
    k, pos = varint.decode(params, pos, f"{codec} k")
    if pos != len(params):
        raise ContainerError(f"{codec} parameters have {len(params) - pos} trailing bytes")
    if not 1 <= chunk <= MAX_CHUNK:
        raise ContainerError(f"{codec} chunk {chunk} is outside [1, {MAX_CHUNK}]")
    if k > chunk:
        raise ContainerError(f"{codec} keeps {k} per chunk of {chunk}")
    if k and uniform_total(numel, chunk, k) != count:
        raise ContainerError(f"{codec}: {k} per chunk of {chunk} over {numel} elements is "
                             f"{uniform_total(numel, chunk, k)} indices, the container has {count}")
    return chunk, k


def count_width(chunk: int) -> int:
    """Bits of one chunk's count in a counted section: ``width_for(C)``."""
    return bitpack.width_for(chunk)


def chunk_lengths(numel: int, chunk: int) -> np.ndarray:
    """The length of every chunk (int64)."""
    m, t = lengths(numel, chunk)
    out = np.full(m + (1 if t else 0), chunk, dtype=np.int64)
    if t:
        out[-1] = t
    return out


def read_counts(codec: str, section: bytes, numel: int, chunk: int, count: int) -> Tuple[np.ndarray, int]:
    """The counts at the start of a counted section and the bytes they took, checked: none above
    its chunk's length, their sum ``count``."""
    chunks = chunk_count(numel, chunk)
    width = count_width(chunk)
    size = bitpack.packed_size(chunks, width)
    if len(section) < size:
        raise ContainerError(f"{codec} section has {len(section)} bytes, fewer than the {size} of its "
                             f"{chunks} chunk counts")
    head = bytes(section[:size])
    check_padding(codec, head, chunks * width)
    counts = np.asarray(bitpack.unpack(head, width, chunks), dtype=np.int64)
    if counts.shape[0] and bool(np.any(counts > chunk_lengths(numel, chunk))):
        raise ContainerError(f"{codec} section counts more indices in a chunk than it has elements")
    if int(counts.sum()) != count:
        raise ContainerError(f"{codec} chunk counts sum to {int(counts.sum())}, the container has {count}")
    return counts, size


def check_padding(codec: str, data: bytes, bits: int) -> None:
    """ContainerError when the bits after the first ``bits`` of ``data`` are not zero."""
    if bits % 8 and data and data[-1] >> (bits % 8):
        raise ContainerError(f"{codec} section has non-zero padding")
