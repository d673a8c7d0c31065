"""Orthonormal DCT-II per chunk or per block: DeMo's transform before its chunked Top-k.

DeMo (ALGORITHMS.md IV.3) transforms every 64 x 64 block of a 2-D weight (every chunk of 64 of a
1-D tensor) with an orthonormal DCT-II, keeps the largest coefficients per block and inverts the
transform after the reduction. The transform is orthonormal and linear, so applying it to the
tensor the pipeline encodes, and its inverse to what the pipeline decodes, is the whole of it:
error feedback held in the transformed domain is the transform of the one held in the parameter
domain, and the sum of transformed messages is the transform of their sum. These functions are
that caller-side step (the pipeline itself sends whatever tensor it is given):

* :func:`block_dct` / :func:`block_idct`: a flat array in the block order of
  ``deepreduce.sparsify.chunked.to_blocks`` (every ``b x b`` block consecutive), each block ``X``
  to ``D X D^T`` and back with ``D^T Y D``;
* :func:`chunk_dct` / :func:`chunk_idct`: every chunk of ``n`` consecutive elements (the tail
  with its own length) to ``D x`` and back.

``D`` is the ``n x n`` DCT-II matrix ``D[k, i] = s_k cos(pi (2 i + 1) k / (2 n))``, ``s_0 =
sqrt(1/n)``, ``s_k = sqrt(2/n)``, computed in float64 and used in the input's dtype. NumPy arrays
or torch tensors (on their device); inverse to the dtype's rounding. Measured on the saved
ResNet-20 convolution gradients (docs/chunked.md), 64 x 64 blocks: Top-32 of each block keeps
25-31 % of the energy after the DCT against 12-18 % before.
"""
from __future__ import annotations

import functools

import numpy as np

from ..backend import arrays
from ..errors import ConfigError


@functools.lru_cache(maxsize=16)
def dct_matrix(n: int) -> np.ndarray:
    """The orthonormal ``n x n`` DCT-II matrix (float64)."""
    k, i = np.arange(n)[:, None], np.arange(n)[None, :]
    out = np.cos(np.pi * (2 * i + 1) * k / (2 * n)) * np.sqrt(2.0 / n)
    out[0] /= np.sqrt(2.0)
    out.setflags(write=False)
    return out


def _matrix(n: int, like):
    """``dct_matrix(n)`` in ``like``'s framework, dtype and device."""
    xp = arrays.namespace(like)
    if type(like) is np.ndarray:
        return dct_matrix(n).astype(like.dtype)
    return xp.astype(arrays.adapter(like).from_numpy(np.ascontiguousarray(dct_matrix(n)), like), like.dtype)


def _blocks(flat, block: int):
    if block < 1 or flat.shape[0] % (block * block):
        raise ConfigError(f"block DCT: {flat.shape[0]} elements are not whole {block}x{block} blocks")
    return arrays.namespace(flat).reshape(flat, (-1, block, block))


def block_dct(flat, block: int = 64):
    """Every ``block x block`` block ``X`` of a block-ordered flat array to ``D X D^T`` (flat)."""
    xp, d = arrays.namespace(flat), _matrix(block, flat)
    return xp.reshape(xp.matmul(xp.matmul(d, _blocks(flat, block)), xp.matrix_transpose(d)), (-1,))


def block_idct(flat, block: int = 64):
    """The inverse of :func:`block_dct`: every block ``Y`` to ``D^T Y D``."""
    xp, d = arrays.namespace(flat), _matrix(block, flat)
    return xp.reshape(xp.matmul(xp.matmul(xp.matrix_transpose(d), _blocks(flat, block)), d), (-1,))


def _by_chunks(flat, chunk: int, inverse: bool):
    if chunk < 1:
        raise ConfigError(f"chunk DCT: chunk {chunk} must be at least 1")
    xp = arrays.namespace(flat)
    m, tail = divmod(flat.shape[0], chunk)
    parts = []
    for length, rows, start in ((chunk, m, 0), (tail, 1 if tail else 0, m * chunk)):
        if not rows:
            continue
        d = _matrix(length, flat)
        x = xp.reshape(flat[start:start + rows * length], (rows, length))
        parts.append(xp.reshape(xp.matmul(x, d) if inverse else xp.matmul(x, xp.matrix_transpose(d)), (-1,)))
    return xp.concat(parts) if parts else flat


def chunk_dct(flat, chunk: int = 64):
    """Every chunk of ``chunk`` consecutive elements ``x`` to ``D x`` (a tail with its own ``D``)."""
    return _by_chunks(flat, chunk, inverse=False)


def chunk_idct(flat, chunk: int = 64):
    """The inverse of :func:`chunk_dct`."""
    return _by_chunks(flat, chunk, inverse=True)
