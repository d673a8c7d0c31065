"""TensorFlow ``IndexedSlices`` gradients as DeepReduce entries, and back.

An embedding lookup's gradient is a ``tf.IndexedSlices``: the touched rows of the variable
(possibly repeated) and one dense slice per index. It travels as the flat positions of the touched
rows' entries (``row * row_size + column``) with their values
(:meth:`deepreduce.pipeline.Pipeline.encode_entries`), as the torch binding sends a sparse COO
gradient (:mod:`deepreduce.torch.sparse`): every index codec and sparsifier applies unchanged, and
a full row is a run of consecutive positions. The summed entries come back as the touched rows,
ascending and distinct, with their summed slices: an ``IndexedSlices`` whose dense value is what
Horovod's allgather of the indices and values adds up to.
"""
from __future__ import annotations

import math
from typing import Tuple

import numpy as np


def entries(indices: np.ndarray, values: np.ndarray, dense_shape) -> Tuple[np.ndarray, np.ndarray]:
    """(ascending distinct flat positions, float32 values) of IndexedSlices parts; repeated rows are
    summed first (in the order they appear), as every reduction of the gradient would add them."""
    inner = math.prod(int(n) for n in dense_shape[1:])
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    rows_values = np.asarray(values, dtype=np.float32).reshape(indices.shape[0], inner)
    order = np.argsort(indices, kind="stable")
    sorted_rows = indices[order]
    starts = np.flatnonzero(np.r_[True, sorted_rows[1:] != sorted_rows[:-1]]) if sorted_rows.size else \
        np.zeros(0, np.int64)
    rows = sorted_rows[starts]
    summed = np.add.reduceat(rows_values[order], starts, axis=0) if rows.size else rows_values[:0]
    positions = (rows[:, None] * inner + np.arange(inner, dtype=np.int64)).reshape(-1)
    return positions, np.ascontiguousarray(summed, dtype=np.float32).reshape(-1)


def rows(positions: np.ndarray, values: np.ndarray, dense_shape) -> Tuple[np.ndarray, np.ndarray]:
    """(ascending distinct rows, their float32 slices of shape ``(rows,) + dense_shape[1:]``) holding
    ``values`` at the flat ``positions``; a row appears where any of its entries does."""
    slice_shape = tuple(int(n) for n in dense_shape[1:])
    inner = math.prod(slice_shape)
    touched, where = np.unique(positions // inner, return_inverse=True)
    out = np.zeros((touched.shape[0], inner), dtype=np.float32)
    out[where, positions % inner] = values
    return touched.astype(np.int64), out.reshape((touched.shape[0],) + slice_shape)
