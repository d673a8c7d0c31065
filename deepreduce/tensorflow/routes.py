"""The reducer's host routes: one host op per tensor, for the sparse all-reduce and the ``auto`` plan.

Under ``aggregation: sparse_allreduce`` or ``auto`` each gradient is reduced by one op that runs
on the host (:class:`HostRoutes`, a part of :class:`deepreduce.tensorflow.reduce.Reducer`): the
protocol's sparse all-reduce, its allgather (``ReductionProtocol.reduce_allgather``) or Horovod's
dense or fp16 all-reduce, as the plan chose for that tensor at this step. The choice is made
when the op runs, so a plan made after the first step applies inside a ``tf.function`` traced
before it. The ops are chained in name order, so every rank runs the collectives alike. Also the
helpers the reducer's ops share: :func:`graph_or_eager`, :func:`step_tensor` and
:func:`tensor_key`.
"""
from __future__ import annotations

import re
from typing import List, Optional

import numpy as np
import tensorflow as tf

from ..dist.protocol import FINE
from .pipeline import numpy_op


class HostRoutes:
    """The host-op routes of the Reducer (it provides ``_protocol``, ``_auto``, ``_routes``,
    ``pipeline``, ``hvd``, ``size`` and ``_process_set_kwargs``)."""

    def _reduce_host(self, grads: List[tf.Tensor], names: List[str], step, reports: list) -> List[tf.Tensor]:
        """Every gradient through one host op (:meth:`_host_one`: the sparse all-reduce or, under
        ``auto``, the planned route), chained in name order so every rank runs the collectives alike."""
        step = step_tensor(step)
        out: List[Optional[tf.Tensor]] = [None] * len(grads)
        found_of: List[Optional[tf.Tensor]] = [None] * len(grads)
        previous: list = []
        for i in sorted(range(len(grads)), key=names.__getitem__):
            def reduce_one(grad, step_value, name=names[i], first=not previous):
                if first and self._auto is not None:   # every gradient of a tape is ready at once
                    self._auto.backward_done()
                total, found = self._host_one(np.ascontiguousarray(grad, dtype=np.float32).reshape(-1), name,
                                              int(step_value))
                return total.reshape(np.shape(grad)), found

            with tf.control_dependencies(previous):
                if tf.executing_eagerly():
                    total, found = (tf.constant(v) for v in reduce_one(np.asarray(grads[i]), np.asarray(step)))
                else:
                    total, found = numpy_op(reduce_one, [grads[i], step], [tf.float32, tf.int64],
                                            "deepreduce_host_reduce")
                    total = tf.reshape(total, tf.shape(grads[i]))
            previous = [total]
            out[i] = tf.cast(total, grads[i].dtype) if grads[i].dtype != tf.float32 else total
            found_of[i] = found
        reports.extend(found_of)
        return out

    def _host_one(self, flat: np.ndarray, name: str, step: int):
        """(the reduced flat float32 array, its report as :meth:`_check`'s) of one tensor: by the
        sparse all-reduce, or by the ``auto`` plan's choice (allgather of containers, dense or fp16
        all-reduce; every tensor goes by allgather until the first plan). Averages directly:
        ``gradient_predivide_factor`` would cancel out."""
        protocol = self._protocol
        route = "sparse_allreduce" if self._auto is None else self._auto.choice(name)
        with self.pipeline.lock:
            if self._auto is not None:
                self._auto.ready(name, flat.size)
                counts = self._routes.setdefault(name, {})
                counts[route] = counts.get(route, 0) + 1
            if route == "sparse_allreduce":
                total, found = protocol.reduce_sparse(flat, name, step)
                if found is not None:
                    protocol.skip(name, step, found)
                return total, np.array(FINE if found is None else found, dtype=np.int64)
            if route in ("dense", "fp16"):
                return self._allreduce_host(protocol.flush_residual(name, flat), name, route), \
                    np.array(FINE, dtype=np.int64)
            total, found = protocol.reduce_allgather(flat, name, step)
            return total, np.array(found, dtype=np.int64)

    def _allreduce_host(self, flat: np.ndarray, name: str, route: str) -> np.ndarray:
        """The sum (or average) of a flat float32 array by Horovod's all-reduce, in fp16 for ``fp16``."""
        send = flat.astype(np.float16) if route == "fp16" else flat
        if route == "dense":
            self.pipeline.core.count_summed_dense(flat.size)
        total = self.hvd.allreduce(tf.constant(send), op=self.hvd.Sum, name=f"{tensor_key(name)}.{route}",
                                   **self._process_set_kwargs()).numpy().astype(np.float32)
        return total / np.float32(self.size) if self._protocol.average else total


def step_tensor(step) -> tf.Tensor:
    """The step as an int64 tensor (0 when None)."""
    return tf.cast(tf.convert_to_tensor(0 if step is None else step), tf.int64)


def graph_or_eager(func, inputs: list, dtype, name: str):
    """``func`` on the inputs' values now (eager: its exceptions keep their type) or as a graph op."""
    if tf.executing_eagerly():
        out = func(*[np.asarray(t) for t in inputs])
        return tuple(tf.constant(o) for o in out) if isinstance(dtype, list) else tf.constant(out)
    return numpy_op(func, inputs, dtype, name)


def tensor_key(name: str) -> str:
    """A Horovod tensor / TF op name for a deepreduce tensor name (same on every rank)."""
    return "DeepReduce_" + re.sub(r"[^A-Za-z0-9_.\-]", "_", name)
