"""How the reducer's dense gradients travel, as TensorFlow ops around the step engine.

:class:`ContainerRoutes` is held by :class:`deepreduce.tensorflow.reduce.Reducer`. With the
config's default aggregation every gradient is an item of the step engine's ``allgather`` route
(:mod:`deepreduce.collective.routes.allgather`), whose phases are ops, as for ``IndexedSlices``
(:class:`~deepreduce.tensorflow.sparse.SliceRoutes`): one host op submits every gradient (the
route encodes it, or sends the failure payload), each container travels by a named
``hvd.allgather`` graph op (:func:`~deepreduce.tensorflow.collectives.gather`), and one host op
finishes the engine (every rank's containers decode-summed, the one ``nonfinite`` decision, the
average). Eagerly with ``background`` on (the default) the engine encodes on its worker thread
while this thread hands each container to its allgather as soon as it is ready, so later encodes
run while earlier collectives wait; ``compression_stats()["encode_hidden_seconds"]`` sums that
encode time (the engine's worker replaced the eager chains of
:func:`deepreduce.collective.overlap.run_chains`).

Under ``aggregation: sparse_allreduce`` or ``auto`` the step's gradients are reduced by one op
that runs on the host: the step engine takes each tensor's route at this step (the sparse
all-reduce, the allgather, or Horovod's dense or fp16 all-reduce). The route is chosen when the
op runs, so a plan made after the first step applies inside a ``tf.function`` traced before it;
the engine issues the collectives in one order on every rank. Also the helpers the reducer's ops
share: :func:`graph_or_eager` and :func:`step_tensor`.
"""
from __future__ import annotations

import functools
import time
from typing import List

import numpy as np
import tensorflow as tf

from ..collective import failure, overlap
from ..collective.ports import Pending
from ..collective.step import Item
from ..errors import CommunicationError
from ..pipeline import dtype_error, to_float32
from .collectives import gather, tensor_key
from .pipeline import numpy_op


class HostCodec:
    """The step engine's codec for a :class:`~deepreduce.tensorflow.pipeline.TFPipeline`: the core
    (``core``, its ``decode_sum``), whose encode is the pipeline's own ``TFPipeline.encode`` (its
    custom op where it has one, else the core) while the config's aggregation is the allgather, so
    the error-feedback residuals stay where that encode keeps them (the ops' variables, which
    ``residual()`` and checkpoints read; the containers are byte-identical either way). Under an
    aggregation every route shares the core's residuals: the core encodes."""

    def __init__(self, pipeline) -> None:
        self.pipeline, self.core = pipeline, pipeline.core
        self._own = pipeline.core.aggregation is None

    def encode(self, grad: np.ndarray, name: str = "", step: int = 0) -> np.ndarray:
        grad = to_float32(grad, name)   # a float64 gradient beyond float32's range raises, as the core's
        if not self._own:
            return self.core.encode(grad, name=name, step=step)
        return self.pipeline.encode(tf.constant(grad), name=name, step=step).numpy()

    def decode_sum(self, payloads, expected_shape=None, out=None) -> np.ndarray:
        return self.core.decode_sum(payloads, expected_shape=expected_shape, out=out)


class ContainerRoutes:
    """How the reducer's dense gradients travel, held by :class:`~deepreduce.tensorflow.reduce.Reducer`:
    its ``pipeline`` and step ``engine`` (None without a pipeline), Horovod (``hvd``,
    ``process_set``), ``op`` ("average" or "sum"), ``predivide`` and the eager ``workers``
    (more than one: the engine encodes on its worker thread)."""

    def __init__(self, pipeline, engine, hvd, process_set, op: str, predivide: float, workers) -> None:
        self.pipeline, self._engine, self.hvd, self.process_set = pipeline, engine, hvd, process_set
        self.op, self.predivide, self.workers = op, predivide, workers
        self._protocol = None if engine is None else engine.protocol

    def reduce(self, grads: List[tf.Tensor], names: List[str], step, reports: list) -> List[tf.Tensor]:
        """Every gradient through the engine's ``allgather`` route as ops (see the module
        docstring), or, under the sparse all-reduce or ``auto``, :meth:`_reduce_host`. A gradient is
        divided by ``gradient_predivide_factor`` before it is encoded and the average multiplied
        by it (Horovod's meaning). The finish op's report is appended to ``reports``; a gradient
        the step skips (a rank failed, or a non-finite container under ``nonfinite: raise``) comes
        back as zeros and the step's end op raises on every rank."""
        if self._protocol.sparse is not None:
            return self._reduce_host(grads, names, step, reports)
        for grad, name in zip(grads, names):
            if not grad.dtype.is_floating:
                raise dtype_error(name, grad.dtype.name)   # the core's message, raised at trace time
        if self.predivide != 1.0:
            grads = [g * tf.cast(1.0 / self.predivide, g.dtype) for g in grads]
        engine, lock, gathers = self._engine, self.pipeline.lock, self._engine.communicator
        keys = [f"deepreduce.{name}" for name in names]   # the engine's name of each allgather
        outs: list = []      # each gradient's result, written by the engine
        started: list = []   # each gradient's start (a future of the engine's worker)

        def start(step_value, *arrays):
            with lock:
                engine.background = self.workers > 1
                outs[:] = [np.zeros(np.shape(a), np.float32) for a in arrays]
                gathers.deferred.update(keys)
                started[:] = [engine.submit(Item(name, int(step_value), np.array(array), target=out))
                              for name, array, out in zip(names, arrays, outs)]
            return np.int64(0)

        def take(i, *token):
            """Gradient ``i``'s container once its start ended (the failure payload where it failed)."""
            item = started[i].result()
            sent = gathers.sent.pop(keys[i], None)
            if sent is None:   # no collective was started for it: every rank's error, or its fail raised
                return failure.payload(item.error or CommunicationError(f"{item.label}: nothing to send"))
            return np.asarray(sent, np.uint8).reshape(-1)

        def finish(step_value, *gathered):
            with lock:
                gathers.received.update(zip(keys, gathered))
                try:
                    engine.finish(int(step_value), end=False)
                finally:
                    gathers.received.clear()
                    gathers.deferred.difference_update(keys)
                    engine.background = False
            return (*outs, np.int64(0))

        inputs = [step_tensor(step)] + [tf.cast(g, tf.float32) if g.dtype in (tf.float16, tf.bfloat16) else g
                                        for g in grads]
        if tf.executing_eagerly():
            start(*[np.asarray(t) for t in inputs])
            gathered = self._eager_gathers(take, started, names)
        else:   # each allgather (no control input) runs once its container is taken, while later ones encode
            token = numpy_op(start, inputs, tf.int64, "deepreduce_start_allgather")
            payloads = [numpy_op(functools.partial(take, i), [token], tf.uint8, "deepreduce_take_container")
                        for i in range(len(names))]
            gathered = [gather(name, tf.reshape(p, [-1]), self.process_set) for name, p in zip(names, payloads)]
        done = graph_or_eager(finish, inputs[:1] + gathered, [tf.float32] * len(grads) + [tf.int64],
                              "deepreduce_finish_allgather")
        reports.append(done[-1])
        out = []
        for total, g in zip(done[:-1], grads):
            total = tf.reshape(total, tf.shape(g))
            if self.op == "average" and self.predivide != 1.0:
                total = total * self.predivide
            out.append(tf.cast(total, g.dtype) if g.dtype != tf.float32 else total)
        return out

    def _eager_gathers(self, take, started, names) -> List[tf.Tensor]:
        """The eager allgathers, each started as soon as its container is ready (with ``background``
        the engine encodes the next ones meanwhile); the encode time and the part of it that ran
        while a collective was in flight go to the pipeline's statistics."""
        gathered, covers = [], []
        for i, name in enumerate(names):
            sent = tf.constant(take(i))
            began = time.perf_counter()
            gathered.append(gather(name, sent, self.process_set))
            covers.append((began, time.perf_counter()))
        spans = [future.result().span for future in started]
        self.pipeline.eager_encode_seconds += sum(b - a for a, b in spans)
        self.pipeline.encode_hidden_seconds += overlap.covered_seconds(spans, covers)
        return gathered

    def _reduce_host(self, grads: List[tf.Tensor], names: List[str], step, reports: list) -> List[tf.Tensor]:
        """Every gradient through one host op running the step engine
        (:class:`deepreduce.collective.step.StepEngine`: each tensor's route at this step, the
        sparse all-reduce's phases, the one ``nonfinite`` decision and divisor; its errors and
        skips are left for the step's end op). Averaging is the engine's
        (``gradient_predivide_factor`` would cancel out). Its report goes to ``reports``."""
        engine, lock, step = self._engine, self.pipeline.lock, step_tensor(step)

        def reduce_all(step_value, *arrays):
            outs = [np.zeros(np.shape(a), np.float32) for a in arrays]
            with lock:
                for name, array, out in zip(names, arrays, outs):
                    engine.submit(Item(name, int(step_value), np.array(array, dtype=np.float32),   # writable: a residual may join it
                                       target=out))
                engine.finish(int(step_value), end=False)
            return (*outs, np.int64(0))

        results = graph_or_eager(reduce_all, [step] + list(grads), [tf.float32] * len(grads) + [tf.int64],
                                 "deepreduce_host_reduce")
        reports.append(results[-1])
        return [tf.cast(tf.reshape(total, tf.shape(g)), g.dtype) if g.dtype != tf.float32
                else tf.reshape(total, tf.shape(g)) for total, g in zip(results[:-1], grads)]


def host_allreduce(hvd, process_set, array: np.ndarray, item, average: bool) -> Pending:
    """The step engine's all-reduce port for the host op (bound to ``hvd`` and ``process_set``):
    Horovod's eager all-reduce (sum, or average) of ``item``'s array, written back into ``array``."""
    result = hvd.allreduce(tf.constant(array), op=hvd.Average if average else hvd.Sum,
                           name=f"{tensor_key(item.name)}.host", process_set=process_set).numpy()
    np.copyto(array, result)
    return Pending(lambda: array)


def step_tensor(step) -> tf.Tensor:
    """The step as an int64 tensor (0 when None)."""
    return tf.cast(tf.convert_to_tensor(0 if step is None else step), tf.int64)


def graph_or_eager(func, inputs: list, dtype, name: str):
    """``func`` on the inputs' values now (eager: its exceptions keep their type) or as a graph op."""
    if tf.executing_eagerly():
        out = func(*[np.asarray(t) for t in inputs])
        return tuple(tf.constant(o) for o in out) if isinstance(dtype, list) else tf.constant(out)
    return numpy_op(func, inputs, dtype, name)
