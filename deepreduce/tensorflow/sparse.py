"""TensorFlow ``IndexedSlices`` gradients as DeepReduce entries, and back.

An embedding lookup's gradient is a ``tf.IndexedSlices``: the touched rows of the variable
(possibly repeated) and one dense slice per index. It travels as the flat positions of the touched
rows' entries (``row * row_size + column``) with their values
(:func:`deepreduce.collective.routes.entries.encode_entries`), as the torch binding sends a sparse COO
gradient (:mod:`deepreduce.torch.sparse`): every index codec and sparsifier applies unchanged, and
a full row is a run of consecutive positions. The summed entries come back as the touched rows,
ascending and distinct, with their summed slices: an ``IndexedSlices`` whose dense value is what
Horovod's allgather of the indices and values adds up to. :class:`SliceRoutes` is the
reducer's part that sends them.
"""
from __future__ import annotations

import math
from typing import Tuple

import numpy as np
import tensorflow as tf

from ..collective import failure
from ..collective.routes.entries import encode_entries
from ..errors import ConfigError
from ..pipeline import to_float32
from ..wire import container
from .collectives import gather
from .routes import graph_or_eager, step_tensor


def refuse_sparse_tensors(grads, names) -> None:
    """A ConfigError naming the first ``tf.SparseTensor`` among ``grads`` (named ``names``):
    gradients travel dense or as ``IndexedSlices`` (what ``tf.GradientTape`` gives for variables),
    as with Horovod, and the error says how to pass one. Checked where gradients enter
    (``DistributedGradientTape.gradient``, ``DistributedOptimizer``), before any conversion, which
    would fail in ``tf.convert_to_tensor``."""
    for grad, name in zip(grads, names):
        if isinstance(grad, tf.SparseTensor):
            raise ConfigError(
                f"gradient {name!r} is a tf.SparseTensor; deepreduce reduces dense tensors and tf.IndexedSlices: pass "
                "tf.sparse.to_dense(grad), or its rows as tf.IndexedSlices(values, row indices, dense_shape)")


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


class SliceRoutes:
    """The IndexedSlices route, held by :class:`~deepreduce.tensorflow.reduce.Reducer`: its
    ``pipeline`` and ``sparse_as_dense``, and its ``containers`` (a
    :class:`~deepreduce.tensorflow.routes.ContainerRoutes`, whose Horovod set, protocol and
    report op the slices share)."""

    def __init__(self, pipeline, sparse_as_dense: bool, containers) -> None:
        self.pipeline, self.sparse_as_dense, self.containers = pipeline, sparse_as_dense, containers
        self._protocol, self.process_set = containers._protocol, containers.process_set

    def native(self, grad) -> bool:
        """Whether ``grad`` travels as an ``IndexedSlices`` (its touched rows): unless
        ``sparse_as_dense``, with a config whose aggregation is the allgather (error feedback
        keeps a sparse residual, ``deepreduce.memory.SparseResidual``), or with Horovod's
        allreduce. The sparse all-reduce and ``auto`` reduce dense tensors."""
        if not isinstance(grad, tf.IndexedSlices) or self.sparse_as_dense:
            return False
        return self.pipeline is None or self._protocol.sparse is None

    def reduce(self, grad: tf.IndexedSlices, name: str, step, reports: list) -> tf.IndexedSlices:
        """One ``IndexedSlices`` gradient through the index and value codecs
        (:mod:`deepreduce.tensorflow.sparse`): this rank's touched entries in one container
        (``routes.entries.encode_entries``), the allgather, and every rank's entries summed
        (``ReductionProtocol.finish_entries``) into the touched rows of every rank, ascending,
        with their summed (or averaged) slices."""
        core, protocol, lock = self.pipeline.core, self._protocol, self.pipeline.lock
        if grad.dense_shape is None:
            raise ConfigError(f"gradient {name!r} is an IndexedSlices without a dense_shape: pass sparse_as_dense=True")
        shape = tf.cast(grad.dense_shape, tf.int64)

        def encode(indices, values, dense_shape, step_value):
            with lock:
                try:
                    flat = to_float32(values, name)
                    return encode_entries(core, *entries(indices, flat, dense_shape), tuple(dense_shape),
                                          name=name, step=int(step_value))
                except Exception as exc:   # noqa: BLE001 (the peers must hear of any error)
                    return failure.payload(exc)

        def decode(gathered, dense_shape, step_value):   # runs where every rank's report was fine
            with lock:
                summed = protocol.finish_entries(container.split(gathered), name, int(step_value), tuple(dense_shape))
            return rows(*summed, dense_shape)

        step = step_tensor(step)
        payload = graph_or_eager(encode, [grad.indices, grad.values, shape, step], tf.uint8,
                                  "deepreduce_encode_entries")
        gathered = gather(name, tf.reshape(payload, [-1]), self.process_set)
        found = self.containers.check_op(name, gathered, step)
        reports.append(found)
        slice_shape = grad.values.shape[1:]

        def nothing():
            return tf.zeros([0], tf.int64), tf.zeros(tf.concat([[0], tf.shape(grad.values)[1:]], 0), tf.float32)

        def decoded():
            touched, summed = graph_or_eager(decode, [gathered, shape, step], [tf.int64, tf.float32],
                                             "deepreduce_decode_entries")
            if slice_shape.rank is not None:
                summed = tf.ensure_shape(summed, [None] + slice_shape.as_list())
            return touched, summed

        touched, summed = self.containers.unless_skipped(found, decoded, nothing)
        return tf.IndexedSlices(tf.cast(summed, grad.values.dtype), tf.cast(touched, grad.indices.dtype),
                                grad.dense_shape)
