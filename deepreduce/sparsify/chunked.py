"""Chunked Top-k (DeMo, SparseLoCo): the ``k`` largest magnitudes of every chunk of ``C`` elements.

The flat gradient is cut into chunks as ``deepreduce.wire.chunks`` describes (full chunks of
``C`` consecutive elements, then a tail of ``t = d mod C`` elements that keeps ``ceil(k t / C)``,
at least 1); a tensor smaller than ``C``, a 1-D bias for instance, is one tail chunk. The count
per chunk is fixed, so every container of a tensor has the same size whatever the gradient, and
the chunk-local index codecs (``chunk_fixed``, ``chunk_enum``) code each chunk's positions
within ``[0, C)``.

Ties at a chunk's cut go to its lowest positions (as ``topk`` does over the whole tensor), so
the selection is a function of the values alone: every rank and binding chooses the same entries.
Written on the array namespace: NumPy (``np.partition`` finds each chunk's k-th magnitude) or
torch tensors on their device (``kthvalue``), the same exact comparisons, so the same positions.

``k`` per chunk is given directly (``k``) or as a ``ratio`` of ``C`` (``k = max(1, floor(ratio
C))``); with neither, ``k = max(1, C // 64)`` (SparseLoCo's 64 of 4096, 1.56 %).

2-D weights in 64 x 64 blocks (the papers' layout) are the caller's layout choice, not the
sparsifier's: :func:`to_blocks` rearranges a matrix so that each block is ``C = b*b``
consecutive elements (and :func:`from_blocks` undoes it); chunks of contiguous rows select as
well for Top-k and need no shape on the wire.
"""
from __future__ import annotations

import numpy as np

from ..backend import arrays, kernels
from ..errors import ConfigError
from ..params import Param
from ..registry import register
from ..wire import chunks
from ._base import Sparsifier


@register
class ChunkTopK(Sparsifier):
    """Top-``k`` by magnitude in every chunk of ``chunk`` elements (fixed count per chunk)."""

    id = "chunk_topk"
    array_api = True
    PARAMS = {
        "chunk": Param(int, default=4096, low=1, high=chunks.MAX_CHUNK, doc="chunk length C"),
        "k": Param(int, default=0, low=0, high=chunks.MAX_CHUNK,
                   doc="entries kept per chunk (0: from ratio, or C // 64 without one)"),
        "ratio": Param(float, default=0.0, low=0.0, high=1.0, doc="k as a fraction of C (0: unused)"),
    }

    def _validate(self) -> None:
        if self.k and self.ratio:
            raise ConfigError(f"sparsifier 'chunk_topk': give k ({self.k}) or ratio ({self.ratio}), not both")
        if self.k > self.chunk:
            raise ConfigError(f"sparsifier 'chunk_topk': k {self.k} is more than the chunk of {self.chunk}")

    @property
    def per_chunk(self) -> int:
        """The ``k`` kept in every full chunk."""
        if self.k:
            return self.k
        if self.ratio:
            return max(1, int(np.floor(self.ratio * self.chunk)))
        return max(1, self.chunk // 64)

    def count(self, numel: int) -> int:
        """Entries kept of a tensor of ``numel`` elements (:func:`deepreduce.wire.chunks.uniform_total`)."""
        return chunks.uniform_total(numel, self.chunk, self.per_chunk)

    def select(self, flat, ctx):
        return chunk_topk_positions(flat, self.chunk, self.per_chunk, self.threads)


def _rows_topk(mag, k: int):
    """Boolean mask of the ``k`` largest of every row of ``mag`` (ties to the lowest columns):
    NumPy, or a torch tensor on its device (the same exact float32 comparisons, so the same mask)."""
    xp = arrays.namespace(mag)
    cols = mag.shape[1]
    if k >= cols:
        return xp.ones(mag.shape, dtype=xp.bool, device=mag.device)
    if type(mag) is np.ndarray:
        kth = -np.partition(-mag, k - 1, axis=1)[:, k - 1:k]      # each row's k-th largest magnitude
    else:
        kth = mag.kthvalue(cols - k + 1, dim=1, keepdim=True).values
    above = mag > kth
    tied = mag == kth
    room = k - xp.sum(xp.astype(above, xp.int64), axis=1, keepdims=True)
    return above | (tied & (xp.cumulative_sum(xp.astype(tied, xp.int64), axis=1) <= room))


def chunk_topk_positions(flat, chunk: int, k: int, threads: int = 1):
    """Ascending int64 positions of the chunked Top-k of the finite 1-D ``flat`` (NumPy, or a torch
    tensor: the positions then are a tensor on its device). A NumPy array goes to the C++ kernel
    when it is built (a sampled bound, then ``nth_element`` among the entries reaching it, per chunk:
    about 2x faster than the array version below, which stays the definition for tensors and the
    NumPy backend; tests compare the two), its chunks split over ``threads`` (the same positions)."""
    _, t = chunks.lengths(flat.shape[0], chunk)
    if type(flat) is np.ndarray:
        module = kernels.native()
        if module is not None:
            tail = chunks.tail_count(min(k, chunk), t, chunk) if t else 0
            return module.chunk_topk(np.ascontiguousarray(flat, dtype=np.float32), chunk, min(k, chunk), tail,
                                     threads)
    return array_chunk_topk_positions(flat, chunk, k)


def array_chunk_topk_positions(flat, chunk: int, k: int):
    """:func:`chunk_topk_positions` on the array namespace (NumPy or torch)."""
    xp = arrays.namespace(flat)
    numel = flat.shape[0]
    m, t = chunks.lengths(numel, chunk)
    mag = xp.abs(xp.astype(flat, xp.float32))
    parts = []
    if m:
        chosen = _rows_topk(xp.reshape(mag[:m * chunk], (m, chunk)), min(k, chunk))
        parts.append(xp.nonzero(xp.reshape(chosen, (-1,)))[0])
    if t:
        tail = _rows_topk(xp.reshape(mag[m * chunk:], (1, t)), chunks.tail_count(min(k, chunk), t, chunk))
        parts.append(xp.nonzero(xp.reshape(tail, (-1,)))[0] + m * chunk)
    if not parts:
        return xp.zeros(0, dtype=xp.int64, device=flat.device)
    return xp.astype(xp.concat(parts), xp.int64)


def to_blocks(matrix: np.ndarray, block: int = 64) -> np.ndarray:
    """A 2-D ``matrix`` whose sides are multiples of ``block`` as a flat array in which every
    ``block x block`` block (row-major order of blocks, row-major inside) is ``block**2``
    consecutive elements: with ``chunk = block**2`` each chunk is one block (DeMo's, SparseLoCo's
    64 x 64 layout). NumPy arrays or torch tensors (on their device)."""
    rows, cols = matrix.shape
    if rows % block or cols % block:
        raise ConfigError(f"to_blocks: a {rows}x{cols} matrix is not made of {block}x{block} blocks")
    xp = arrays.namespace(matrix)
    tiles = xp.reshape(matrix, (rows // block, block, cols // block, block))
    return xp.reshape(xp.permute_dims(tiles, (0, 2, 1, 3)), (-1,))


def from_blocks(flat: np.ndarray, shape, block: int = 64) -> np.ndarray:
    """The inverse of :func:`to_blocks`: the ``shape`` matrix of a block-ordered flat array."""
    rows, cols = shape
    if rows % block or cols % block or flat.shape[0] != rows * cols:
        raise ConfigError(f"from_blocks: {flat.shape[0]} elements are not a {rows}x{cols} matrix "
                          f"of {block}x{block} blocks")
    xp = arrays.namespace(flat)
    tiles = xp.reshape(flat, (rows // block, cols // block, block, block))
    return xp.reshape(xp.permute_dims(tiles, (0, 2, 1, 3)), (rows, cols))
