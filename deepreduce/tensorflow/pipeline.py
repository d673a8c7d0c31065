"""The TensorFlow face of a pipeline: tf tensors in, the core's exact bytes out, as graph ops.

Horovod calls a TensorFlow compressor (and a tape's reduction code) once, while ``tf.function``
traces the graph, so every stage of compression has to be a graph op that runs at each step.
Encode and decode are therefore one op each:

* for the configs whose every stage exists in C++ (Top-r or threshold selection with or without
  error feedback, raw, Elias-Fano or Bloom indices, raw, fp16 or polyfit values) and when the custom-op library
  (``deepreduce/tensorflow/_deepreduce_ops.so``, see :mod:`.ops`) loads, a TensorFlow C++ op
  (``DeepReduceEncode`` / ``DeepReduceDecode``) over the same C++ kernels and container code
  as the Python extensions;
* for every other config, one ``tf.numpy_function`` op calling the NumPy core's
  ``encode`` / ``decode_sum``.

Either way the container is byte-identical to ``deepreduce.build(config).encode`` for the same
input, name and step (tests/test_tensorflow_ops.py checks every config).

Cost of the ``numpy_function`` path (measured figures in docs/tensorflow.md): each call holds
the Python GIL, copies the gradient out of the TF buffer once (``.numpy()`` is zero-copy for a
CPU tensor, the float32 cast and ravel usually are too) and the payload back once, and adds the
fixed price of a Python call from the TF runtime (tens of microseconds). The op is marked
``stateful`` so TF never constant-folds or deduplicates it (error-feedback residuals and step
counters change between calls). Neither path runs on a GPU: on a GPU machine the gradient is
copied to host memory before compression -- which the allgather of a byte payload needs anyway.

The step may be a Python int or an integer tensor (``optimizer.iterations``); the tensor name
is a Python string fixed at trace time, as Horovod's own tensor names are.
"""
from __future__ import annotations

import hashlib
import json
import threading
import weakref
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from .. import checkpoint
from ..config import ConfigLike, load_config
from ..config import build as build_core
from ..errors import CommunicationError, ConfigError
from ..pipeline import Pipeline, dtype_error, to_float32
from ..stats import CompressionStats
from ..wire import container
from .fpenv import default_floating_point


def numpy_op(func, inputs, dtypes, name: str):
    """A stateful ``tf.numpy_function`` op running ``func`` as plain Python.

    ``func`` runs with the default floating-point environment (TF's op threads flush denormals
    to zero; the core must compute as it does anywhere else, see :mod:`.fpenv`).
    ``do_not_convert`` keeps AutoGraph from rewriting it (inside ``tf.function`` it would
    otherwise run every call through AutoGraph's converted-call machinery, which is slower).
    Stateful: TF never folds, caches or deduplicates it (residuals and counters change).
    """
    def run(*args):
        with default_floating_point():
            return func(*args)

    return tf.numpy_function(tf.autograph.experimental.do_not_convert(run), inputs, dtypes,
                             stateful=True, name=name)


class TFPipeline:
    """Wraps a core :class:`~deepreduce.Pipeline` for TensorFlow tensors, eager or in ``tf.function``.

    ``encode(tensor, name=, step=)`` returns a 1-D ``tf.uint8`` tensor holding one container;
    ``decode(payload)`` returns a float32 tensor of the original shape. Per-tensor state (error
    feedback residuals) and statistics live in the pipeline (in the core, or in TF variables on
    the ops path), so build one ``TFPipeline`` per training run and keep it (see :func:`build`).

    ``iterations`` is a step counter owned by the pipeline (an int64 ``tf.Variable`` created
    with the pipeline, lifted out of any ``tf.function`` being traced), used by
    :class:`~deepreduce.tensorflow.DistributedGradientTape` when no explicit step is given.
    """

    BACKENDS = ("auto", "tf-ops", "numpy_function")

    def __init__(self, core: Pipeline, backend: str = "auto") -> None:
        if backend not in self.BACKENDS:
            raise ConfigError(f"TFPipeline: backend {backend!r}; allowed: {', '.join(self.BACKENDS)}")
        self.core = core
        with tf.init_scope():   # created once, with the pipeline, even while a tf.function traces
            self._iterations = tf.Variable(0, dtype=tf.int64, trainable=False, name="deepreduce_iterations")
        # TF may run the py_func ops of several gradients at once; the core's statistics and
        # residual dict are updated under this lock so concurrent calls never interleave.
        self.lock = threading.RLock()
        # eager reductions (deepreduce.tensorflow.reduce): wall time of their encode calls, and the
        # part of it that ran while another tensor's collective or decode was in flight
        self.eager_encode_seconds = 0.0
        self.encode_hidden_seconds = 0.0
        # the reducer's ReductionProtocol per (process set, average), kept here so that a new tape
        # each step (Horovod's idiom) keeps the sparse all-reduce's owner residuals and the auto plan
        self.protocols: dict = {}
        from . import ops  # noqa: WPS433 (late import: ops imports the core's components)

        if backend == "numpy_function":
            self._ops = None
        elif backend == "tf-ops":
            reason = ops.unsupported(core)
            if reason is not None:
                raise ConfigError(f"TFPipeline: backend 'tf-ops' runs Top-r or threshold selection with raw/bloom "
                                  f"indices and raw/fp16/polyfit values as custom ops; this config has {reason}")
            self._ops = ops.PipelineOps(core, ops.load())   # raises with the rebuild command
        else:
            self._ops = ops.accelerator_for(core)

    # ------------------------------------------------------------------ properties
    @property
    def stats(self) -> CompressionStats:
        """Running :class:`~deepreduce.CompressionStats`: the core's plus what the ops did."""
        merged = CompressionStats(**{k: v for k, v in self.core.stats.as_dict().items() if k != "relative_volume"})
        if self._ops is not None:
            for key, value in self._ops.counts().items():
                setattr(merged, key, getattr(merged, key) + value)
        return merged

    def compression_stats(self) -> dict:
        """:attr:`stats` as a dict, with two figures of the eager reductions of
        :mod:`deepreduce.tensorflow.reduce` (0 inside ``tf.function``): ``eager_encode_seconds``,
        the wall time of their encode calls (the codec's ``encode_seconds`` plus TensorFlow's
        dispatch and, with worker threads, waits for the GIL or a core), and
        ``encode_hidden_seconds``, the part of it that ran while another tensor's allgather or
        decode was in flight (0 with ``background=False``). See docs/tensorflow.md."""
        out = self.stats.as_dict()
        out.update(eager_encode_seconds=self.eager_encode_seconds, encode_hidden_seconds=self.encode_hidden_seconds)
        return out

    def get_config(self) -> dict:
        return self.core.get_config()

    @property
    def backend(self) -> str:
        """``"tf-ops"`` when the custom ops encode and decode, else ``"numpy_function"``."""
        return "numpy_function" if self._ops is None else "tf-ops"

    @property
    def iterations(self) -> tf.Variable:
        """This pipeline's own step counter."""
        return self._iterations

    def residual(self, name: str) -> Optional[np.ndarray]:
        """The error-feedback residual held for tensor ``name`` (flat float32), or None."""
        if self._ops is not None:
            return self._ops.residual(name)
        residual = getattr(self.core.memory, "residual", None)
        return residual(name) if residual is not None else None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """``{"format", "step", "compression"}`` (deepreduce/checkpoint.py, as the torch integrations
        save it): :attr:`iterations` and what the pipeline learned -- the error-feedback residuals
        (held by the ops' variables or the core) and the components' adaptive state -- as NumPy
        arrays. Save it with the model (``np.savez``, pickle, or as ``tf.Variable`` values); a
        pipeline built from the same config and given it through :meth:`load_state_dict` sends
        byte-identical containers to one that never stopped, with either backend.
        """
        with self.lock:
            learned = self.core.state_dict()
            if self._ops is not None and self._ops.error_feedback:   # dense residuals in the ops, sparse in the core
                learned["memory"]["residuals"].update(self._ops.residuals())
            return checkpoint.state(int(self._iterations.numpy()), learned)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (refused for a checkpoint of another config)."""
        step = checkpoint.checked_step(state, "TFPipeline")
        with self.lock:
            self.core.load_state_dict(state["compression"])   # checks the config digest and every entry
            if self._ops is not None and self._ops.error_feedback:   # the ops hold the dense residuals
                residuals = state["compression"]["memory"]["residuals"]
                dense = {name: r for name, r in residuals.items() if not isinstance(r, dict)}
                self._ops.load_residuals(dense)
                for name in dense:   # the core keeps only the sparse ones (IndexedSlices, SparseResidual)
                    self.core.memory.restore(name, None)
            self._iterations.assign(step)

    # ------------------------------------------------------------------ encode
    def encode(self, tensor, name: str = "", step=0, on_error=None) -> tf.Tensor:
        """One container for ``tensor`` as a 1-D ``tf.uint8`` tensor (a graph op under tf.function).

        ``on_error`` (the distributed reducer passes it): a function from the exception to the
        bytes to send instead. An encode error then gives those bytes rather than raising, so a
        rank whose gradient cannot be encoded still joins the step's collectives: eagerly for
        any error, inside ``tf.function`` for the stages that run in Python (the float64 range
        check, the ``numpy_function`` encode); the custom op's own failures still raise.
        """
        tensor = tf.convert_to_tensor(tensor)
        if on_error is not None and tf.executing_eagerly():
            try:
                return self.encode(tensor, name, step)
            except Exception as exc:   # noqa: BLE001 (any error: the peers must hear of it)
                return tf.constant(on_error(exc), tf.uint8)
        if not tensor.dtype.is_floating:
            raise dtype_error(name, tensor.dtype.name)   # the core's message, raised at trace time
        if tensor.dtype == tf.float64:   # the core's checked conversion: overflow is reported as such
            if on_error is not None:
                tensor, failure = _checked_float32(tensor, name, on_error)
                out = tf.cond(tf.size(failure) > 0, lambda: failure,
                              lambda: self.encode(tensor, name, step, on_error))
                out.set_shape([None])
                return out
            tensor = _checked_float32(tensor, name)
        tensor = tf.cast(tensor, tf.float32) if tensor.dtype != tf.float32 else tensor
        if self._ops is not None:
            out = self._ops.encode(tensor, name, tf.cast(step, tf.int64))
        elif tf.executing_eagerly():
            # eager: call the core directly (no py_func round trip; deepreduce errors keep their type)
            with self.lock:
                out = tf.constant(self.core.encode(tensor.numpy(), name=name, step=_int_step(step)))
        else:
            core, lock = self.core, self.lock

            def _encode(grad: np.ndarray, step_value) -> np.ndarray:
                with lock:
                    try:
                        return core.encode(grad, name=name, step=int(step_value))
                    except Exception as exc:   # noqa: BLE001
                        if on_error is None:
                            raise
                        return np.asarray(on_error(exc), dtype=np.uint8)

            out = numpy_op(_encode, [tensor, tf.cast(step, tf.int64)], tf.uint8, "deepreduce_encode")
        out.set_shape([None])
        return out

    # ------------------------------------------------------------------ decode
    def decode(self, payload, expected_shape: Optional[Sequence[int]] = None) -> tf.Tensor:
        """The float32 tensor one container describes.

        ``expected_shape`` (optional) is checked against the header at run time and also gives
        the result its static shape inside ``tf.function``.
        """
        shape = _shape_tuple(expected_shape)
        core, lock = self.core, self.lock

        def _decode(buf: np.ndarray) -> np.ndarray:
            with lock:
                return np.asarray(core.decode(buf, shape), dtype=np.float32, order="C")   # 0-d stays 0-d

        return self._decode_op(payload, shape, None, True, _decode, "deepreduce_decode")

    def decode_sum(self, gathered, expected_shape: Optional[Sequence[int]] = None,
                   count: Optional[int] = None) -> tf.Tensor:
        """Sum of the tensors in the concatenation of several containers (an allgather result).

        ``count`` (optional) is the number of containers expected (the number of ranks); a
        different number raises :class:`~deepreduce.CommunicationError`.
        """
        shape = _shape_tuple(expected_shape)
        core, lock = self.core, self.lock

        def _decode_sum(buf: np.ndarray) -> np.ndarray:
            parts = container.split(buf)
            if count is not None and len(parts) != count:
                raise CommunicationError(f"allgather returned {len(parts)} containers for {count} ranks")
            with lock:
                return np.asarray(core.decode_sum(parts, shape), dtype=np.float32, order="C")

        return self._decode_op(gathered, shape, count, False, _decode_sum, "deepreduce_decode_sum")

    def _decode_op(self, payload, shape, count, single: bool, decode, name: str) -> tf.Tensor:
        """The decode op: the custom op, the core called eagerly, or one numpy_function op."""
        if self._ops is not None:
            return self._ops.decode(tf.convert_to_tensor(payload, dtype=tf.uint8), shape, count, single)
        if tf.executing_eagerly():
            return tf.constant(decode(_eager_bytes(payload)))
        out = numpy_op(decode, [tf.convert_to_tensor(payload, dtype=tf.uint8)], tf.float32, name)
        if shape is not None:
            out.set_shape(shape)
        return out

    def __repr__(self) -> str:
        return f"TFPipeline({self.core.get_config()!r}, backend={self.backend!r})"


def _checked_float32(tensor: tf.Tensor, name: str, on_error=None):
    """A float64 tensor as float32 through :func:`deepreduce.pipeline.to_float32` (overflow raises).

    With ``on_error``: (the float32 tensor, the 1-D uint8 ``on_error(exc)`` of a failed
    conversion or an empty one) instead of raising (see :meth:`TFPipeline.encode`)."""
    if on_error is None:
        if tf.executing_eagerly():
            return tf.constant(to_float32(tensor.numpy(), name))
        out = numpy_op(lambda g: to_float32(g, name), [tensor], tf.float32, "deepreduce_to_float32")
        out.set_shape(tensor.shape)
        return out

    def convert(grad: np.ndarray):
        try:
            return to_float32(grad, name), np.zeros(0, np.uint8)
        except Exception as exc:   # noqa: BLE001
            return np.zeros(grad.shape, np.float32), np.asarray(on_error(exc), dtype=np.uint8)

    out, failure = numpy_op(convert, [tensor], [tf.float32, tf.uint8], "deepreduce_to_float32")
    out.set_shape(tensor.shape)
    failure.set_shape([None])
    return out, failure


def _shape_tuple(shape) -> Optional[tuple]:
    return None if shape is None else tuple(int(s) for s in shape)


def _int_step(step) -> int:
    if isinstance(step, (tf.Tensor, tf.Variable)) or hasattr(step, "numpy"):
        return int(np.asarray(step.numpy() if hasattr(step, "numpy") else step))
    return int(step)


def _eager_bytes(payload) -> np.ndarray:
    if hasattr(payload, "numpy"):
        payload = payload.numpy()
    return np.asarray(payload)


def build(config: ConfigLike, backend: str = "auto") -> TFPipeline:
    """Build a TensorFlow pipeline from a config path, dict, core Pipeline or TFPipeline.

    Build it once per training run (outside ``tf.function``) and pass the same object to every
    ``DistributedGradientTape``/``DistributedOptimizer``: it holds the residuals and counters.

    ``backend``: ``"auto"`` encodes and decodes with the TF custom ops when the config qualifies
    (:func:`deepreduce.tensorflow.ops.unsupported`) and they load, else with ``tf.numpy_function``;
    ``"tf-ops"`` requires them (error naming the reason or the rebuild command);
    ``"numpy_function"`` never uses them. All three write the same bytes; docs/tensorflow.md
    compares their cost.
    """
    if isinstance(config, TFPipeline):
        return config
    return TFPipeline(config if isinstance(config, Pipeline) else build_core(config), backend=backend)


_shared_lock = threading.Lock()
# per place of the pipelines' variables (see _shared_here): (by config digest, by id(core))
_shared_eager: Tuple[Dict[Tuple[str, str], TFPipeline], Dict[int, TFPipeline]] = ({}, {})
_shared_in_graph: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _shared_here():
    """The shared pipelines whose variables can be used here: a pipeline's variables live where
    ``tf.init_scope`` puts them, the eager context (eager steps and every ``tf.function`` trace)
    or a ``tf.compat.v1`` graph; a step run eagerly and then built in a graph needs one of each."""
    with tf.init_scope():
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    if graph is None:
        return _shared_eager
    if graph not in _shared_in_graph:
        _shared_in_graph[graph] = ({}, {})
    return _shared_in_graph[graph]


def config_digest(config: ConfigLike) -> str:
    """SHA-256 of a config's normalised form (every default filled in): equal configs, equal digests."""
    canonical = json.dumps(load_config(config), sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@tf.autograph.experimental.do_not_convert   # plain Python, also when called in a traced step
def shared(config: ConfigLike, backend: str = "auto") -> TFPipeline:
    """The one TFPipeline of ``config`` in this process, built on first use and then reused.

    This is what lets a ``DistributedGradientTape`` be created inside the ``tf.function`` step
    (Horovod's TF2 pattern) with a config path or dict: every trace and every eager step finds
    the same pipeline, so its residuals, statistics and ``iterations`` variable are created
    once. A TFPipeline is returned as is; a core Pipeline maps to one TFPipeline per object
    (by identity); a path or dict maps to one per normalised config (by :func:`config_digest`),
    so two equal configs share state. Shared pipelines live as long as the process (those of a
    ``tf.compat.v1`` graph as long as the graph: a step run eagerly and then built in a graph
    gets a pipeline in each, :func:`_shared_here`). Two models trained in one process with equal configs
    therefore need separately built pipelines (:func:`build`) or distinct tensor names.
    """
    if isinstance(config, TFPipeline):
        return config
    with _shared_lock:
        by_digest, by_core = _shared_here()
        if isinstance(config, Pipeline):
            pipe = by_core.get(id(config))
            if pipe is None or pipe.core is not config:
                pipe = by_core[id(config)] = TFPipeline(config, backend=backend)
            return pipe
        key = (config_digest(config), backend)
        pipe = by_digest.get(key)
        if pipe is None:
            pipe = by_digest[key] = TFPipeline(build_core(config), backend=backend)
        return pipe
