"""GradiVeQ for TensorFlow: a summable Horovod compressor whose codes an ordinary allreduce sums.

Use it in unmodified Horovod, ``hvd.DistributedGradientTape(tape, compression=GradiVeQ())`` (or
``hvd.DistributedOptimizer`` for a v1 optimizer), or in deepreduce's own TF tape and Keras
optimizer. The algorithm is :mod:`deepreduce.summable.gradiveq` (slicing, PCA training, compression,
decompression, schedule); this adapter only runs it at every step inside graph ops and keeps
each tensor's state. Kernels are taken in TensorFlow's layout ``(H, W, D, F)``.

Horovod calls ``compress``/``decompress`` while a graph is traced (its tape and optimizer
compile the reduction even when eager), so a tensor is identified by its place in the traced
function: (shape, dtype, position among same-shaped tensors in the outermost function being
traced). A retrace of the same function finds the same states. Outside any graph a tensor is
identified by (shape, dtype) alone, so eager direct ``hvd.allreduce`` calls on same-shaped
tensors would share a state; use a ``tf.function`` there.

Each floating tensor with a static shape goes through one ``tf.numpy_function`` op per
direction: the raw gradient (flattened, float32) in warm-up and sampling steps, the code in
compression steps; ``decompress`` returns the tensor in its shape and dtype. Other tensors pass
through untouched.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np
import tensorflow as tf

from ..summable import gradiveq as gv
from .pipeline import numpy_op


@dataclass
class _TensorState:
    shape: Tuple[int, ...]
    plan: Optional[gv.SlicePlan]
    t: int = 0
    phase: str = "warmup"
    coded: bool = False                       # the last compress sent a code
    window: Optional[gv.SampleWindow] = None
    model: Optional[gv.Model] = None


@dataclass(frozen=True)
class _Ctx:
    key: Optional[tuple]                       # None: passed through untouched
    shape: Tuple[int, ...]
    dtype: tf.DType


def _outermost_graph():
    """The outermost function graph being traced (a ``tf.cond`` branch belongs to its function), or None."""
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    # a function graph has ``outer_graph``; the eager context's graph above the outermost has not
    while hasattr(getattr(graph, "outer_graph", None), "outer_graph"):
        graph = graph.outer_graph
    return graph


class GradiVeQ(gv.Settings):
    """Horovod-compatible GradiVeQ compressor for TensorFlow (``compress``/``decompress``).

    Arguments: those of :class:`deepreduce.summable.gradiveq.Settings` and ``deepreduce.torch.GradiVeQ``
    (the paper's schedule 2,500 / 100 / 400 iterations), with ``layout="tf"``.
    """

    def __init__(self, loss: float = 0.01, reuse: int = 0, slice_size: int = 0, max_slice: int = 4096,
                 min_numel: int = 1024, warmup: int = 2500, sample_iters: int = 100,
                 compress_iters: int = 400, layout: str = "tf") -> None:
        super().__init__(loss, reuse, slice_size, max_slice, min_numel, warmup, sample_iters, compress_iters, layout)
        self._states: Dict[tuple, _TensorState] = {}
        self._occurrence: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self.stats = {"compressed": 0, "uncompressed": 0, "dense_elements": 0, "sent_elements": 0,
                      "trainings": 0}

    def compression_stats(self) -> dict:
        """Counts of compressed/uncompressed sends, element volumes, and per-tensor ``d``."""
        with self._lock:
            out = dict(self.stats)
            out["dims"] = {str(k): s.model.dims for k, s in self._states.items() if s.model is not None}
        out["ratio"] = out["dense_elements"] / out["sent_elements"] if out["sent_elements"] else 1.0
        return out

    def model(self, key) -> Optional[gv.Model]:
        """The trained model of the tensor with state key ``key`` (see ``compression_stats()['dims']``)."""
        state = self._states.get(key)
        return None if state is None else state.model

    # ---------------------------------------------------------------- keys and state
    def _key(self, shape: Tuple[int, ...], dtype: tf.DType, name: Optional[str] = None) -> tuple:
        sig = (shape, dtype.name)
        if name is not None:
            return sig + (name,)
        graph = _outermost_graph()
        if graph is None:
            return sig + (0,)
        counts = self._occurrence.setdefault(graph, {})
        occ = counts.get(sig, 0)
        counts[sig] = occ + 1
        return sig + (occ,)

    def _state(self, key: tuple, shape: Tuple[int, ...]) -> _TensorState:
        with self._lock:
            state = self._states.get(key)
            if state is None:
                state = self._states[key] = _TensorState(shape, self.plan(shape))
            return state

    # ---------------------------------------------------------------- NumPy stages (run at every step)
    def _compress_array(self, state: _TensorState, grad: np.ndarray) -> np.ndarray:
        with self._lock:
            state.phase = self.schedule.phase(state.t)
            state.coded = state.plan is not None and state.phase == "compress" and state.model is not None
            if state.coded:
                code = gv.compress(state.model, *gv.to_slices(grad.astype(np.float32, copy=False), state.plan))
                self.stats["compressed"] += 1
            else:
                code = np.ascontiguousarray(grad, dtype=np.float32).reshape(-1)
                self.stats["uncompressed"] += 1
            self.stats["dense_elements"] += grad.size
            self.stats["sent_elements"] += code.size
            return code

    def _decompress_array(self, state: _TensorState, reduced: np.ndarray) -> np.ndarray:
        with self._lock:
            if state.coded:
                out = gv.from_slices(*gv.decompress(state.model, reduced), state.plan)
            else:
                out = reduced.reshape(state.shape)
                if state.phase == "sample" and state.plan is not None:
                    if state.window is None:
                        state.window = gv.SampleWindow(state.plan, self.schedule.sample_iters, self.loss)
                    model = state.window.add(gv.to_slices(out, state.plan)[0])
                    if model is not None:
                        state.model, state.window = model, None
                        self.stats["trainings"] += 1
            state.t += 1
            return np.asarray(out, dtype=np.float32, order="C")   # 0-d stays 0-d

    # ---------------------------------------------------------------- Horovod contract
    accepts_name = True   # compress(tensor, name=...): the state is the named tensor's

    def compress(self, tensor, name: Optional[str] = None):
        """``(tensor to allreduce, context)``: the code in compression steps, else the flat
        gradient. ``name`` (optional) identifies the tensor's state (see the module docstring)."""
        tensor = tf.convert_to_tensor(tensor)
        if not tensor.dtype.is_floating or not tensor.shape.is_fully_defined():
            return tensor, _Ctx(None, (), tensor.dtype)
        shape = tuple(int(s) for s in tensor.shape)
        key = self._key(shape, tensor.dtype, name)
        state = self._state(key, shape)
        code = numpy_op(lambda g: self._compress_array(state, g), [tensor], tf.float32, "gradiveq_compress")
        code.set_shape([None])
        return code, _Ctx(key, shape, tensor.dtype)

    def decompress(self, tensor, ctx: _Ctx):
        """The aggregated gradient in its shape and dtype; advances the tensor's schedule."""
        if ctx.key is None:
            return tensor
        state = self._states[ctx.key]
        out = numpy_op(lambda r: self._decompress_array(state, r), [tensor], tf.float32, "gradiveq_decompress")
        out.set_shape(ctx.shape)
        return tf.cast(out, ctx.dtype) if ctx.dtype != tf.float32 else out
