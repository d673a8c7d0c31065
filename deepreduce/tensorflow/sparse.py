"""TensorFlow ``IndexedSlices`` gradients as DeepReduce entries, and back.

An embedding lookup's gradient is a ``tf.IndexedSlices``: the touched rows of the variable
(possibly repeated) and one dense slice per index. It travels as the flat positions of the touched
rows' entries (``row * row_size + column``) with their values
(:func:`deepreduce.collective.routes.entries.encode_entries`, on the step engine's ``entries`` route, whose
phases are ops: :meth:`SliceRoutes.reduce`), as the torch binding sends a sparse COO gradient (:mod:`deepreduce.torch.sparse`): every index codec and sparsifier applies unchanged, and
a full row is a run of consecutive positions. The summed entries come back as the touched rows,
ascending and distinct, with their summed slices: an ``IndexedSlices`` whose dense value is what
Horovod's allgather of the indices and values adds up to. :class:`SliceRoutes` is the
reducer's part that sends them.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np
import tensorflow as tf

from ..collective.ports import NumpyTensors, Pending
from ..collective.step import Item
from ..errors import CommunicationError, ConfigError
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


@dataclass(eq=False)
class Slices:
    """One ``IndexedSlices`` gradient on the host, as the step engine's item carries it."""

    name: str
    indices: np.ndarray
    values: np.ndarray
    dense_shape: Tuple[int, ...]


class SliceTensors(NumpyTensors):
    """The step engine's tensor port for the reducer's host op: flat float32 NumPy arrays
    (:class:`~deepreduce.collective.ports.NumpyTensors`) and :class:`Slices`, which take the
    engine's ``entries`` route."""

    @staticmethod
    def is_sparse(tensor) -> bool:
        return isinstance(tensor, Slices)

    @staticmethod
    def shape(tensor) -> Sequence[int]:
        return tensor.dense_shape if isinstance(tensor, Slices) else tuple(np.shape(tensor))

    @staticmethod
    def entries(tensor: Slices) -> Tuple[np.ndarray, np.ndarray]:
        return entries(tensor.indices, to_float32(tensor.values, tensor.name), tensor.dense_shape)

    @staticmethod
    def from_entries(positions: np.ndarray, values: np.ndarray, like: Slices):
        return rows(positions, values, like.dense_shape)


class SliceRoutes:
    """The IndexedSlices route, held by :class:`~deepreduce.tensorflow.reduce.Reducer`: its
    ``pipeline`` and ``sparse_as_dense``, and its ``containers`` (a
    :class:`~deepreduce.tensorflow.routes.ContainerRoutes`, whose Horovod set and step engine the
    slices share)."""

    def __init__(self, pipeline, sparse_as_dense: bool, containers) -> None:
        self.pipeline, self.sparse_as_dense, self.containers = pipeline, sparse_as_dense, containers
        self._engine, self.process_set = containers._engine, containers.process_set

    def native(self, grad) -> bool:
        """Whether ``grad`` travels as an ``IndexedSlices`` (its touched rows): unless
        ``sparse_as_dense``, with a config whose aggregation is the allgather (error feedback
        keeps a sparse residual, ``deepreduce.memory.SparseResidual``), or with Horovod's
        allreduce. The sparse all-reduce and ``auto`` reduce dense tensors."""
        if not isinstance(grad, tf.IndexedSlices) or self.sparse_as_dense:
            return False
        return self.pipeline is None or self._engine.protocol.sparse is None

    def reduce(self, grads: List[tf.IndexedSlices], names: List[str], step, reports: list) -> List[tf.IndexedSlices]:
        """The ``IndexedSlices`` gradients through the step engine's ``entries`` route
        (:mod:`deepreduce.collective.routes.entries`) as three ops: one host op submits every
        gradient (each rank's touched entries in one container, ``routes.entries.encode_entries``, or
        the failure payload), each container travels by a named ``hvd.allgather`` graph op
        (:func:`~deepreduce.tensorflow.collectives.gather`, which Horovod fuses), and one host op
        finishes the engine: every rank's entries summed (averaged under ``op=Average``) into the
        touched rows of every rank, ascending, with their summed slices. Its errors and skips are
        left for the step's end op (its report goes to ``reports``; a skipped gradient comes back
        with no rows)."""
        if not grads:
            return []
        for grad, name in zip(grads, names):
            if grad.dense_shape is None:
                raise ConfigError(f"gradient {name!r} is an IndexedSlices without a dense_shape: "
                                  "pass sparse_as_dense=True")
        engine, lock, gathers = self._engine, self.pipeline.lock, self._engine.communicator
        keys = [f"deepreduce.{name}" for name in names]   # the engine's name of each allgather
        results = [None] * len(names)   # each gradient's (rows, slices), set by the engine's write
        inner = [()] * len(names)   # each gradient's slice shape, for an empty result

        def start(step_value, *arrays):
            with lock:
                for i, name in enumerate(names):
                    indices, values, dense_shape = arrays[3 * i:3 * i + 3]
                    slices = Slices(name, np.asarray(indices), np.asarray(values), tuple(int(n) for n in dense_shape))
                    inner[i] = tuple(np.shape(values)[1:])
                    gathers.deferred.add(keys[i])
                    engine.submit(Item(name, int(step_value), slices, replace=functools.partial(results.__setitem__, i)))
                return [np.asarray(gathers.sent.pop(key), dtype=np.uint8).reshape(-1) for key in keys]

        def finish(step_value, *gathered):
            with lock:
                gathers.received.update(zip(keys, gathered))
                try:
                    engine.finish(int(step_value), end=False)
                finally:
                    gathers.received.clear()
                    gathers.deferred.difference_update(keys)
            out = []
            for i, found in enumerate(results):   # None: skipped (the step's end raises on every rank)
                out += found if found is not None else \
                    [np.zeros(0, np.int64), np.zeros((0,) + inner[i], np.float32)]
                results[i] = None
            return (*out, np.int64(0))

        inputs = [step_tensor(step)]
        for grad in grads:
            inputs += [grad.indices, grad.values, tf.cast(grad.dense_shape, tf.int64)]
        payloads = graph_or_eager(start, inputs, [tf.uint8] * len(grads), "deepreduce_start_entries")
        gathered = [gather(name, tf.reshape(p, [-1]), self.process_set) for name, p in zip(names, payloads)]
        done = graph_or_eager(finish, inputs[:1] + gathered, [tf.int64, tf.float32] * len(grads) + [tf.int64],
                              "deepreduce_finish_entries")
        reports.append(done[-1])
        out = []
        for i, grad in enumerate(grads):
            touched, summed = done[2 * i], done[2 * i + 1]
            slice_shape = grad.values.shape[1:]
            if slice_shape.rank is not None:
                summed = tf.ensure_shape(summed, [None] + slice_shape.as_list())
            out.append(tf.IndexedSlices(tf.cast(summed, grad.values.dtype), tf.cast(touched, grad.indices.dtype),
                                        grad.dense_shape))
        return out


class DeferredGathers:
    """The reducer's transport for its step engine: Horovod's (``communicator``: rank, size, the
    sparse all-reduce's collectives), except that the allgathers named in ``deferred`` are left to
    graph ops: their payload waits in ``sent`` for the start op to hand it over, and their
    result, put in ``received`` by the finish op, is what the engine's wait returns."""

    def __init__(self, communicator) -> None:
        self.communicator = communicator
        self.deferred: set = set()
        self.sent: dict = {}
        self.received: dict = {}

    def __getattr__(self, attr):
        return getattr(self.communicator, attr)

    def allgather_async(self, payload, name: str) -> Pending:
        if name not in self.deferred:
            return self.communicator.allgather_async(payload, name)
        self.sent[name] = payload

        def wait() -> list:
            if name not in self.received:
                raise CommunicationError(f"allgather of {name!r} returned nothing; every rank skips this step")
            parts = container.split(self.received.pop(name))
            if len(parts) != self.communicator.size:
                raise CommunicationError(f"allgather of {name!r} returned {len(parts)} containers for "
                                         f"{self.communicator.size} ranks")
            return parts
        return Pending(wait)
