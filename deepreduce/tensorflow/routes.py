"""How the reducer's dense gradients travel, as TensorFlow ops: containers, or one host op each.

:class:`ContainerRoutes` is held by :class:`deepreduce.tensorflow.reduce.Reducer`. With the
config's default aggregation each gradient is encoded into a container (a graph op), gathered by
``hvd.allgather`` (:func:`~deepreduce.tensorflow.collectives.gather`), checked
(``ReductionProtocol.report``) and decode-summed. Eagerly, each op runs when it is called, so one
tensor after another would make every encode wait for the previous tensor's allgather round trip;
with ``background`` on (the default) the eager chains run on a few worker threads instead
(:func:`deepreduce.collective.overlap.run_chains`), and ``compression_stats()["encode_hidden_seconds"]``
sums the encode time that ran while another tensor's collective or decode was in flight. Inside
``tf.function`` all encodes come first in program order (see :meth:`ContainerRoutes.reduce`).

Under ``aggregation: sparse_allreduce`` or ``auto`` the step's gradients are reduced by one op
that runs on the host: the step engine takes each tensor's route at this step (the sparse
all-reduce, the allgather, or Horovod's dense or fp16 all-reduce). The route is chosen when the
op runs, so a plan made after the first step applies inside a ``tf.function`` traced before it;
the engine issues the collectives in one order on every rank. Also the helpers the reducer's ops share: :func:`graph_or_eager` and
:func:`step_tensor`.
"""
from __future__ import annotations

from typing import List

import numpy as np
import tensorflow as tf

from ..collective import failure, overlap
from ..collective.ports import Pending
from ..collective.step import Item
from ..wire import container
from .collectives import gather, tensor_key
from .pipeline import numpy_op


class ContainerRoutes:
    """How the reducer's dense gradients travel, held by :class:`~deepreduce.tensorflow.reduce.Reducer`:
    its ``pipeline`` and step ``engine`` (None without a pipeline), Horovod (``hvd``,
    ``process_set``), ``op`` ("average" or "sum"), ``predivide`` and the eager ``workers``."""

    def __init__(self, pipeline, engine, hvd, process_set, op: str, predivide: float, workers) -> None:
        self.pipeline, self._engine, self.hvd, self.process_set = pipeline, engine, hvd, process_set
        self.op, self.predivide, self.workers = op, predivide, workers
        self._protocol = None if engine is None else engine.protocol

    @property
    def size(self) -> int:
        return self.process_set.size()

    def reduce(self, grads: List[tf.Tensor], names: List[str], step, reports: list) -> List[tf.Tensor]:
        """Every gradient through encode -> ``hvd.allgather`` -> decode_sum (or, under the sparse
        all-reduce or ``auto``, :meth:`_reduce_host`); each tensor's report (:meth:`_check_op`) is
        appended to ``reports``.

        Eagerly, each tensor's chain runs as one task of :func:`deepreduce.collective.overlap.run_chains`:
        on ``background`` worker threads, so encodes proceed while other tensors' collectives and
        decodes are in flight, or one after another on this thread; the encode times and their
        overlap go to the pipeline's statistics. Inside ``tf.function`` every encode comes first
        in program order, then each tensor's allgather and decode: TensorFlow chains stateful
        ops that take no resource (the encode and decode ops) in program order, so the
        per-tensor order would make each encode wait for the previous tensor's decode; this
        order lets tensor i's allgather (a stateless op) run while tensor i+1 encodes.
        """
        if self._protocol.sparse is not None:
            return self._reduce_host(grads, names, step, reports)
        if tf.executing_eagerly():
            results, seconds, hidden = overlap.run_chains(
                lambda i: self._encode(grads[i], names[i], step),
                lambda i, payload: self._gather_decode(grads[i], names[i], payload, step), range(len(grads)), self.workers)
            self.pipeline.eager_encode_seconds += seconds
            self.pipeline.encode_hidden_seconds += hidden
        else:
            payloads = [self._encode(g, n, step) for g, n in zip(grads, names)]
            results = [self._gather_decode(g, n, p, step) for g, n, p in zip(grads, names, payloads)]
        reports.extend(found for _, found in results)
        return [total for total, _ in results]

    def _encode(self, grad: tf.Tensor, name: str, step) -> tf.Tensor:
        """This rank's container of ``grad`` (divided first by ``gradient_predivide_factor``), or
        the protocol's failure payload where the encode raised (the rank stays in phase)."""
        if self.predivide != 1.0:
            grad = grad * tf.cast(1.0 / self.predivide, grad.dtype)
        return self.pipeline.encode(grad, name=name, step=step, on_error=failure.payload)

    def _gather_decode(self, grad: tf.Tensor, name: str, payload: tf.Tensor, step):
        """(the average or sum over ranks of ``grad``, its report: see :meth:`_check_op`)."""
        gathered = gather(name, payload, self.process_set)
        size = self.size
        shape = grad.shape if grad.shape.is_fully_defined() else None
        found = self.check_op(name, gathered, step)
        total = self.unless_skipped(found, lambda: self.pipeline.decode_sum(gathered, shape, count=size),
                                     lambda: tf.zeros(tf.shape(grad), tf.float32))
        if shape is None:
            total = tf.reshape(total, tf.shape(grad))
        if self.op == "average":
            total = total * (self.predivide / size)
        return (tf.cast(total, grad.dtype) if grad.dtype != tf.float32 else total), found

    def check_op(self, name: str, gathered: tf.Tensor, step) -> tf.Tensor:
        """This tensor's ``ReductionProtocol.report`` on the gathered bytes, as an int64 op (eagerly: now)."""
        def check(buf, step_value):
            with self.pipeline.lock:
                return np.array(self._protocol.report(container.split(buf), name, int(step_value)), dtype=np.int64)

        return graph_or_eager(check, [gathered, step_tensor(step)], tf.int64, "deepreduce_check")

    @staticmethod
    def unless_skipped(found: tf.Tensor, decode, nothing):
        """``decode()`` unless the report says some rank failed or sent a non-finite container
        (``nothing()`` then: the step's end raises on every rank once the step's collectives ran)."""
        skip = tf.not_equal(found[0], -1)
        if tf.executing_eagerly():
            return nothing() if bool(skip) else decode()
        return tf.cond(skip, nothing, decode, name="deepreduce_decode_unless_skipped")

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
