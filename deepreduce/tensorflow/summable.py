"""A summable compressor's gradients on the step engine's ``summable`` route, as TensorFlow ops.

A Horovod-style compressor (``hvd.Compression.fp16``, :class:`deepreduce.tensorflow.GradiVeQ`)
maps a gradient to codes an all-reduce sums. Its tensors travel by the step engine
(:class:`deepreduce.collective.step.StepEngine`, route :mod:`deepreduce.collective.routes.summable`),
as on torch, so the outcome of one step is decided in one place:

* a compress that raises on one rank sends zero codes and a raised failure flag (one more element
  of the all-reduce, :func:`deepreduce.collective.routes.dense.flagged`): every rank reads the
  summed flag and raises (the failing rank its own error, the others a CommunicationError), no rank
  writes a gradient, and the next step runs in phase;
* a NaN/Inf reaches the optimizer (a summable compressor has no ``nonfinite`` option) and is
  counted in ``compression_stats()["nonfinite_propagated"]``.

The engine's phases are ops: one ``tf.numpy_function`` per step runs :meth:`StepEngine.submit`
for every tensor (the compressor's ``compress`` runs eagerly inside it at every step, so its
errors are caught there, inside ``tf.function`` too; the engine's tensor port is
:class:`CodeTensors`); each tensor's flagged codes go through
``hvd.allreduce`` as an ordinary graph op (named, fused by Horovod, with ``op`` and the
predivide factors as Horovod's own wrapper applies them); one more op hands the sums back and
runs :meth:`StepEngine.finish`, which decompresses and raises the step's error on every rank.
Eagerly the same calls run directly. The gradients depend on the finish op, so a failed step applies
nothing. The data elements are summed (or averaged) by the same Horovod collective on the same
codes as ``hvd.DistributedOptimizer(compression=...)``, so the result is bit-identical to it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Dict, List, Sequence

import numpy as np
import tensorflow as tf

from ..collective.comm.horovod import HorovodCommunicator
from ..collective.ports import NumpyTensors, Pending
from ..collective.step import Item, StepEngine
from ..errors import CommunicationError
from .collectives import tensor_key
from .routes import step_tensor

_ENGINES: Dict[tuple, "Kept"] = {}   # (compressor, process set, average, names) ids -> what one list of tensors keeps


class Exchange:
    """The engine's all-reduce port for the ops: a route's start records what it sends (a NumPy
    array), the graph's ``hvd.allreduce`` carries it, and the finish op hands each sum back
    (:attr:`received`), written into the sent array when the engine waits for it.
    ``targets``: each tensor's result array."""

    def __init__(self) -> None:
        self.sent: Dict[str, np.ndarray] = {}
        self.received: Dict[str, np.ndarray] = {}
        self.targets: Dict[str, np.ndarray] = {}

    def __call__(self, sent: np.ndarray, item: Item, average: bool) -> Pending:
        self.sent[item.name] = sent

        def wait() -> np.ndarray:
            if item.name not in self.received:
                raise CommunicationError(f"{item.label} at step {item.step}: its all-reduce returned nothing; "
                                         "every rank skips this step")
            np.copyto(sent, self.received.pop(item.name))
            return sent
        return Pending(wait)


@dataclass
class Kept:
    """What a list of tensors keeps across steps and tapes: its ``engine`` and ``exchange`` (so a
    rank whose compress fails sends zeros shaped like its last codes), each tensor's code dtype
    (``dtypes``, by name, shape and dtype), the ``compressor`` (holding its id) and the ``lock``
    its ops take (a graph may run them on several threads)."""

    compressor: object
    engine: StepEngine
    exchange: Exchange
    dtypes: Dict[tuple, tf.DType] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class CodeTensors(NumpyTensors):
    """The engine's tensor port here: NumPy arrays, except that the codes handed to the
    compressor's ``decompress`` are TF tensors, as Horovod hands them."""

    @staticmethod
    def like(flat, shaped):
        return tf.convert_to_tensor(np.reshape(flat, np.shape(shaped)))


class NumpyCodes:
    """The compressor as the engine sees it: NumPy in, NumPy codes out (what the route sizes a
    failed rank's zeros by), the compressor itself between TF tensors (as Horovod calls it)."""

    accepts_name = True

    def __init__(self, compressor) -> None:
        self.compressor = compressor

    def compress(self, array, name: str = ""):
        codes, ctx = compress(self.compressor, tf.convert_to_tensor(array), name)
        return np.asarray(codes), ctx

    def decompress(self, codes, ctx):
        return self.compressor.decompress(codes, ctx)


def host_op(func, inputs: list, dtypes: list, name: str) -> list:
    """A stateful ``tf.numpy_function`` op. Unlike the pipeline's ops (``numpy_op``) it keeps
    TensorFlow's floating-point environment: the compressor's TF ops run inside it, as they
    would in the graph."""
    return tf.numpy_function(tf.autograph.experimental.do_not_convert(func), inputs, dtypes, stateful=True, name=name)


def compress(compressor, tensor, name: str):
    """``compressor.compress(tensor)``, with the tensor's name where it ``accepts_name``."""
    if getattr(compressor, "accepts_name", False):
        return compressor.compress(tensor, name=name)
    return compressor.compress(tensor)


class SummableRoutes:
    """The summable route's ops, held by :class:`~deepreduce.tensorflow.reduce.Reducer`: its
    ``compressor``, Horovod (``hvd``, ``process_set``), the Horovod ``op`` (``hvd.Average`` or
    ``hvd.Sum``) and ``predivide`` (``gradient_predivide_factor``, applied as Horovod does: scaled
    before the sum and back after it)."""

    def __init__(self, compressor, hvd, process_set, op, predivide: float) -> None:
        self.compressor, self.hvd, self.process_set, self.op = compressor, hvd, process_set, op
        self.predivide = predivide
        self._communicator = HorovodCommunicator(framework="tensorflow")
        if process_set is not hvd.global_process_set:
            self._communicator.process_set = process_set

    def engines(self) -> List[StepEngine]:
        """Every step engine of this compressor, process set and op (one per list of tensor names)."""
        key = (id(self.compressor), id(self.process_set), self.op == self.hvd.Average)
        return [kept.engine for k, kept in _ENGINES.items() if k[:3] == key]

    def stats(self) -> dict:
        """The engines' figures summed: steps applied, NaN/Inf tensors written, encode (compress)
        and communication seconds."""
        out = {"steps": 0, "nonfinite_propagated": 0, "encode_seconds": 0.0, "communication_wait_seconds": 0.0,
               "decode_seconds": 0.0}
        for engine in self.engines():
            figures = engine.stats()
            for key in out:
                out[key] += figures[key]
        return out

    def _kept(self, names: Sequence[str]) -> Kept:
        """What this list of tensors keeps (:class:`Kept`); one per list, so that two reductions
        in one graph never finish each other's tensors."""
        key = (id(self.compressor), id(self.process_set), self.op == self.hvd.Average, tuple(names))
        kept = _ENGINES.get(key)
        if kept is None:
            exchange = Exchange()
            engine = StepEngine(None, self._communicator, CodeTensors(), exchange, average=key[2], background=False,
                                compressor=NumpyCodes(self.compressor), worker="deepreduce-tf-summable")
            kept = _ENGINES.setdefault(key, Kept(self.compressor, engine, exchange))
        return kept

    def _code_dtype(self, kept: Kept, grad: tf.Tensor, name: str) -> tf.DType:
        """The dtype of the compressor's codes for ``grad``, traced once in a scratch graph (no op
        runs). Where that trace raises, the gradient's dtype: the step's own compress (in the
        engine) then reports the error on every rank."""
        key = (name, tuple(grad.shape), grad.dtype)
        if key not in kept.dtypes:
            traced = tf.function(lambda t: compress(self.compressor, t, name)[0], autograph=False)
            try:
                with tf.init_scope():
                    spec = tf.TensorSpec(grad.shape, grad.dtype)
                    return kept.dtypes.setdefault(key, traced.get_concrete_function(spec).structured_outputs.dtype)
            except Exception:   # noqa: BLE001 (not cached: the next step traces again)
                return grad.dtype
        return kept.dtypes[key]

    def reduce(self, grads: List[tf.Tensor], names: List[str], step) -> List[tf.Tensor]:
        """Every dense gradient through the engine's summable route (see the module docstring)."""
        if not grads:
            return []
        kept = self._kept(names)
        engine, exchange = kept.engine, kept.exchange
        dtypes = [self._code_dtype(kept, g, n) for g, n in zip(grads, names)]

        def start(step_value, *arrays):   # every tensor's compress and flag (the engine's submit)
            sent = []
            with kept.lock:
                for name, array, dtype in zip(names, arrays, dtypes):
                    grad = np.asarray(array)
                    exchange.targets[name] = np.zeros_like(grad)
                    engine.submit(Item(name, int(step_value), grad, target=exchange.targets[name]))
                    sent.append(np.asarray(exchange.sent.pop(name), dtype=dtype.as_numpy_dtype))
            return sent

        def finish(step_value, *summed):   # the engine's finish: every tensor decompressed, or raise
            with kept.lock:
                exchange.received.update(zip(names, summed))
                try:
                    engine.finish(int(step_value), order=names)
                finally:
                    exchange.received.clear()
                return [exchange.targets.pop(n) for n in names]

        inputs = [step_tensor(step)] + list(grads)
        if tf.executing_eagerly():
            sent = [tf.constant(codes) for codes in start(*[np.asarray(t) for t in inputs])]
            try:
                summed = [self._allreduce(codes, name) for codes, name in zip(sent, names)]
            except Exception:
                self._drain(kept)
                raise
            results = [tf.constant(r) for r in finish(inputs[0].numpy(), *[s.numpy() for s in summed])]
        else:
            sent = host_op(start, inputs, dtypes, "deepreduce_summable_start")
            for codes in sent:
                codes.set_shape([None])
            summed = [self._allreduce(codes, name) for codes, name in zip(sent, names)]
            results = host_op(finish, inputs[:1] + summed, [g.dtype for g in grads], "deepreduce_summable_finish")
        for result, grad in zip(results, grads):
            result.set_shape(grad.shape)
        return list(results)

    def _drain(self, kept: Kept) -> None:
        """Forget a step whose all-reduce raised (a Horovod error, on every rank): the engine ends
        it with nothing received, so the next step starts empty. Inside ``tf.function`` the finish
        op does not run after such an error: the next step's finish ends both (it raises once)."""
        with kept.lock:
            kept.exchange.received.clear()
            try:
                kept.engine.finish(0)
            except Exception:   # noqa: BLE001 (the all-reduce's own error is the one raised)
                pass
            kept.exchange.targets.clear()
            kept.exchange.sent.clear()

    def _allreduce(self, sent: tf.Tensor, name: str) -> tf.Tensor:
        """The flagged codes summed (or averaged) by ``hvd.allreduce``, named as the tensor."""
        kwargs = {}
        if self.predivide != 1.0:
            kwargs.update(prescale_factor=1.0 / self.predivide, postscale_factor=self.predivide)
        return self.hvd.allreduce(sent, op=self.op, name=tensor_key(name), process_set=self.process_set, **kwargs)
