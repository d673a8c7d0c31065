"""The TensorFlow face of a pipeline: tf tensors in, the core's exact bytes out, as graph ops.

Horovod calls a TensorFlow compressor (and a tape's reduction code) once, while ``tf.function``
traces the graph, so every stage of compression has to be a graph op that runs at each step.
The encode and decode stages are therefore ops:

* the framework-neutral stages (error feedback, sparsifier, codecs, container packing) run in
  ``tf.numpy_function`` ops over the NumPy core. The container is byte-identical to
  ``deepreduce.build(config).encode`` for the same input, name and step *by construction*,
  since it is the core that writes it;
* where the config uses the Bloom-filter index codec or a curve-fitting value codec and the
  custom-op library (``deepreduce/tensorflow/_deepreduce_ops.so``, see :mod:`.ops`) is loaded,
  the hot kernels of those codecs run as TensorFlow C++ ops (``REGISTER_OP``) wrapping the
  same C++ functions as the Python extension; see :mod:`.ops` for what is routed.

Cost of the ``numpy_function`` path (measured figures in docs/tensorflow.md): each call holds
the Python GIL, copies the gradient out of the TF buffer once (``.numpy()`` is zero-copy for a
CPU tensor, the float32 cast and ravel usually are too) and the payload back once, and adds the
fixed price of a Python call from the TF runtime (tens of microseconds). The op is marked
``stateful`` so TF never constant-folds or deduplicates it (error-feedback residuals and step
counters change between calls); it cannot be placed on a GPU, so on a GPU machine the gradient
is copied to host memory before compression -- which the allgather of a byte payload needs
anyway.

The step may be a Python int or an integer tensor (``optimizer.iterations``); the tensor name
is a Python string fixed at trace time, as Horovod's own tensor names are.
"""
from __future__ import annotations

import hashlib
import json
import threading
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from .. import container
from ..config import ConfigLike, build as build_core, load_config
from ..errors import CommunicationError, ConfigError
from ..pipeline import Pipeline, dtype_error, to_float32
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


def _static_shape(shape) -> Optional[tuple]:
    """A fully known shape as a tuple of ints, or None."""
    if shape is None:
        return None
    shape = tf.TensorShape(shape)
    if not shape.is_fully_defined():
        return None
    return tuple(int(s) for s in shape.as_list())


class TFPipeline:
    """Wraps a core :class:`~deepreduce.Pipeline` for TensorFlow tensors, eager or in ``tf.function``.

    ``encode(tensor, name=, step=)`` returns a 1-D ``tf.uint8`` tensor holding one container;
    ``decode(payload)`` returns a float32 tensor of the original shape. Per-tensor state (error
    feedback residuals) and statistics live in the wrapped core pipeline, so build one
    ``TFPipeline`` per training run and keep it (see :func:`build`).

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
        from . import ops  # noqa: WPS433 (late import: ops imports this module's siblings)

        if backend == "numpy_function":
            self._accel = None
        elif backend == "tf-ops":
            if not ops.OpsEncoder.routes(core):
                raise ConfigError(
                    f"TFPipeline: backend 'tf-ops' needs a codec with TF custom ops (index "
                    f"{'/'.join(ops.OPS_INDEX_CODECS)} or value {'/'.join(ops.OPS_VALUE_CODECS)}); "
                    f"this config uses index {core.index.id!r} and value {core.value.id!r}"
                )
            self._accel = ops.OpsEncoder(core, ops.load(), self.lock)   # raises with the rebuild command
        else:
            self._accel = ops.accelerator_for(core, self.lock)

    # ------------------------------------------------------------------ properties
    @property
    def stats(self):
        """The core's running :class:`~deepreduce.CompressionStats`."""
        return self.core.stats

    def compression_stats(self) -> dict:
        return self.core.stats.as_dict()

    def get_config(self) -> dict:
        return self.core.get_config()

    @property
    def backend(self) -> str:
        """``"tf-ops"`` when custom ops run the Bloom/fit kernels, else ``"numpy_function"``."""
        return "numpy_function" if self._accel is None else "tf-ops"

    @property
    def iterations(self) -> tf.Variable:
        """This pipeline's own step counter."""
        return self._iterations

    # ------------------------------------------------------------------ encode
    def encode(self, tensor, name: str = "", step=0) -> tf.Tensor:
        """One container for ``tensor`` as a 1-D ``tf.uint8`` tensor (a graph op under tf.function)."""
        tensor = tf.convert_to_tensor(tensor)
        if not tensor.dtype.is_floating:
            raise dtype_error(name, tensor.dtype.name)   # the core's message, raised at trace time
        if tensor.dtype == tf.float64:   # the core's checked conversion: overflow is reported as such
            tensor = _checked_float32(tensor, name)
        tensor = tf.cast(tensor, tf.float32) if tensor.dtype != tf.float32 else tensor
        if self._accel is not None:
            step = tf.cast(tf.convert_to_tensor(step), tf.int64)
            out = self._accel.encode(tensor, name, step)
        elif tf.executing_eagerly():
            # eager: call the core directly (no py_func round trip; deepreduce errors keep their type)
            with self.lock:
                out = tf.constant(self.core.encode(tensor.numpy(), name=name, step=_int_step(step)))
        else:
            core = self.core
            step = tf.cast(tf.convert_to_tensor(step), tf.int64)

            lock = self.lock

            def _encode(grad: np.ndarray, step_value) -> np.ndarray:
                with lock:
                    return core.encode(grad, name=name, step=int(step_value))

            out = numpy_op(_encode, [tensor, step], tf.uint8, "deepreduce_encode")
        out.set_shape([None])
        return out

    # ------------------------------------------------------------------ decode
    def decode(self, payload, expected_shape: Optional[Sequence[int]] = None) -> tf.Tensor:
        """The float32 tensor one container describes.

        ``expected_shape`` (optional) is checked against the header at run time and also gives
        the result its static shape inside ``tf.function``.
        """
        core = self.core
        shape = None if expected_shape is None else tuple(int(s) for s in expected_shape)

        lock = self.lock

        def _decode(buf: np.ndarray) -> np.ndarray:
            with lock:
                return np.ascontiguousarray(core.decode(buf, shape), dtype=np.float32)

        if tf.executing_eagerly():
            return tf.constant(_decode(_eager_bytes(payload)))
        if self._accel is not None and self._accel.routes_decode:
            return self._accel.decode_sum(tf.convert_to_tensor(payload, dtype=tf.uint8), shape, 1, summed=False)
        out = numpy_op(_decode, [tf.convert_to_tensor(payload, dtype=tf.uint8)], tf.float32, "deepreduce_decode")
        if shape is not None:
            out.set_shape(shape)
        return out

    def decode_sum(self, gathered, expected_shape: Optional[Sequence[int]] = None,
                   count: Optional[int] = None) -> tf.Tensor:
        """Sum of the tensors in the concatenation of several containers (an allgather result).

        ``count`` (optional) is the number of containers expected (the number of ranks); a
        different number raises :class:`~deepreduce.CommunicationError`.
        """
        core = self.core
        shape = None if expected_shape is None else tuple(int(s) for s in expected_shape)

        lock = self.lock

        def _decode_sum(buf: np.ndarray) -> np.ndarray:
            parts = container.split(buf)
            if count is not None and len(parts) != count:
                raise CommunicationError(f"allgather returned {len(parts)} containers for {count} ranks")
            with lock:
                return np.ascontiguousarray(core.decode_sum(parts, shape), dtype=np.float32)

        if tf.executing_eagerly():
            return tf.constant(_decode_sum(_eager_bytes(gathered)))
        if self._accel is not None and self._accel.routes_decode and count is not None:
            return self._accel.decode_sum(tf.convert_to_tensor(gathered, dtype=tf.uint8), shape, count)
        out = numpy_op(_decode_sum, [tf.convert_to_tensor(gathered, dtype=tf.uint8)], tf.float32,
                       "deepreduce_decode_sum")
        if shape is not None:
            out.set_shape(shape)
        return out

    def __repr__(self) -> str:
        return f"TFPipeline({self.core.get_config()!r}, backend={self.backend!r})"


def _checked_float32(tensor: tf.Tensor, name: str) -> tf.Tensor:
    """A float64 tensor as float32 through :func:`deepreduce.pipeline.to_float32` (overflow raises)."""
    if tf.executing_eagerly():
        return tf.constant(to_float32(tensor.numpy(), name))
    out = numpy_op(lambda g: to_float32(g, name), [tensor], tf.float32, "deepreduce_to_float32")
    out.set_shape(tensor.shape)
    return out


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

    ``backend``: ``"auto"`` routes Bloom/polyfit work through the TF custom ops when they load
    (else ``tf.numpy_function``); ``"tf-ops"`` requires them (error with the rebuild command);
    ``"numpy_function"`` never uses them. All three write the same bytes; docs/tensorflow.md
    compares their cost.
    """
    if isinstance(config, TFPipeline):
        return config
    return TFPipeline(config if isinstance(config, Pipeline) else build_core(config), backend=backend)


_shared_lock = threading.Lock()
_shared_by_digest: Dict[Tuple[str, str], TFPipeline] = {}
_shared_by_core: Dict[int, TFPipeline] = {}   # id(core) -> pipeline (which holds the core)


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
    so two equal configs share state. Shared pipelines live as long as the process. Two models trained in one process with equal configs
    therefore need separately built pipelines (:func:`build`) or distinct tensor names.
    """
    if isinstance(config, TFPipeline):
        return config
    with _shared_lock:
        if isinstance(config, Pipeline):
            pipe = _shared_by_core.get(id(config))
            if pipe is None or pipe.core is not config:
                pipe = _shared_by_core[id(config)] = TFPipeline(config, backend=backend)
            return pipe
        key = (config_digest(config), backend)
        pipe = _shared_by_digest.get(key)
        if pipe is None:
            pipe = _shared_by_digest[key] = TFPipeline(build_core(config), backend=backend)
        return pipe
