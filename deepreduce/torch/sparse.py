"""Torch sparse COO gradients as DeepReduce entries, and back.

``nn.Embedding(sparse=True)`` / ``EmbeddingBag(sparse=True)`` produce a hybrid COO gradient: one
sparse dimension (the touched rows, possibly repeated) and dense rows of ``embedding_dim``. It
travels as the flat positions of the touched rows' entries (``row * dim + column``) with their
values (:func:`deepreduce.collective.routes.entries.encode_entries`): the container format, every index
codec and every sparsifier apply unchanged, and full rows are runs of consecutive positions that
the delta / Elias-Fano / RLE index codecs pack into little more than one number per row. (Rows as
a 2-D gather would send one index per row but needs a second container layout and does not let a
sparsifier pick single entries.) The summed entries come back as a coalesced COO gradient with
the original's sparse dimensions, the layout a torch optimizer gets from Horovod or DDP.
"""
from __future__ import annotations

import math
from typing import Tuple

import numpy as np
import torch


def entries(grad: torch.Tensor) -> Tuple[np.ndarray, np.ndarray]:
    """(ascending distinct flat positions, float32 values) of a sparse COO gradient (coalesced
    first: repeated rows are summed, as every reduction of it would)."""
    grad = grad.coalesce()
    sparse_dim, shape = grad.sparse_dim(), tuple(grad.shape)
    inner = math.prod(shape[sparse_dim:])
    indices = grad.indices().cpu().numpy()
    rows = np.ravel_multi_index(tuple(indices), shape[:sparse_dim]) if indices.shape[1] else np.zeros(0, np.int64)
    positions = (rows[:, None] * inner + np.arange(inner, dtype=np.int64)).reshape(-1)
    values = grad.values().detach().to(torch.float32).cpu().numpy().reshape(-1)
    return positions.astype(np.int64, copy=False), values


def from_entries(positions: np.ndarray, values: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A coalesced COO tensor shaped, typed and placed like the sparse ``like`` (same sparse
    dimensions) holding ``values`` at the flat ``positions``; rows of ``like``'s sparse dimensions
    appear where any of their entries does."""
    sparse_dim, shape = like.sparse_dim(), tuple(like.shape)
    inner = math.prod(shape[sparse_dim:])
    rows, where = np.unique(positions // inner, return_inverse=True)
    dense_rows = np.zeros((rows.shape[0], inner), dtype=np.float32)
    dense_rows[where, positions % inner] = values
    indices = np.stack(np.unravel_index(rows, shape[:sparse_dim])) if rows.shape[0] else \
        np.zeros((sparse_dim, 0), dtype=np.int64)
    # rows are distinct, ascending and in bounds by construction (np.unique of checked positions)
    return torch.sparse_coo_tensor(torch.from_numpy(indices.astype(np.int64)),
                                   torch.from_numpy(dense_rows).reshape((rows.shape[0],) + shape[sparse_dim:]),
                                   shape, dtype=like.dtype, device=like.device, check_invariants=False,
                                   is_coalesced=True)
