"""The TensorFlow custom ops: one op encodes a tensor, one op decodes (and sums) containers.

``scripts/build_tf_ops.sh`` compiles ``csrc/tf/tf_pipeline_ops.cpp`` (glue: tensors in and out)
with every pure C++ source of ``csrc/`` into ``deepreduce/tensorflow/_deepreduce_ops.so``;
``make setup`` runs it. The ops call the C++ pipeline subset of ``csrc/pipeline``, the functions
``deepreduce._pipeline`` binds for NumPy:

* ``DeepReduceEncode`` is ``Pipeline.encode`` for one gradient: error feedback fused with the
  Top-r selection (or followed by threshold selection), the raw, Elias-Fano or Bloom index codec
  (every policy), the raw, fp16 or polyfit value codec (with its permutation) and the container, header
  and CRC included. It updates the tensor's residual in place, inside its resource variable.
* ``DeepReduceDecode`` is ``Pipeline.decode_sum`` (or ``decode``) over an allgather result.

They serve the configs whose every stage exists in C++ and that propagate non-finite gradients
(:func:`unsupported` says why another config does not
qualify); every other config runs its encode and its decode as one ``tf.numpy_function`` stage
each over the core (see :mod:`.pipeline`). The attributes of the ops come from the core
pipeline's components (:attr:`deepreduce.pipeline.Pipeline.native_settings`).

:func:`load` returns the op module (cached); if the library is missing or was built against
another TensorFlow, it raises :class:`~deepreduce.BackendUnavailableError` naming the rebuild
command.
"""
from __future__ import annotations

import os
import struct
import threading
import warnings
from typing import Dict, Optional

import numpy as np
import tensorflow as tf
from tensorflow.python.ops.resource_variable_ops import ResourceVariable

from .. import errors
from ..backend._native import forced_numpy
from ..errors import BackendUnavailableError

LIBRARY_NAME = "_deepreduce_ops.so"
LIBRARY_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY_NAME)
REBUILD_HINT = (
    "rebuild the TensorFlow custom ops against the installed TensorFlow with "
    "`bash scripts/build_tf_ops.sh` (or `make setup`) from the deepreduce project root"
)
#: The int64 statistics vector both ops return (csrc/tf/tf_pipeline_ops.cpp, enum Stat).
STATS = ("tensors_encoded", "tensors_decoded", "dense_bytes", "wire_bytes", "index_bytes", "value_bytes",
         "permutation_bytes", "header_bytes", "encode_ns", "decode_ns")

_lock = threading.Lock()
_state = {"module": None, "error": None, "warned": False}


def load():
    """The loaded op module (``tf.load_op_library``), loaded at most once per process."""
    with _lock:
        if _state["module"] is not None:
            return _state["module"]
        if _state["error"] is not None:
            raise BackendUnavailableError(_state["error"])
        if not os.path.isfile(LIBRARY_PATH):
            _state["error"] = f"TensorFlow custom ops {LIBRARY_PATH} are not built; {REBUILD_HINT}"
            raise BackendUnavailableError(_state["error"])
        try:
            _state["module"] = tf.load_op_library(LIBRARY_PATH)
        except (tf.errors.NotFoundError, tf.errors.OpError, OSError) as exc:
            _state["error"] = (
                f"TensorFlow custom ops {LIBRARY_PATH} could not be loaded into TensorFlow "
                f"{tf.__version__} ({str(exc).strip()}); they were probably built against another "
                f"TensorFlow version; {REBUILD_HINT}"
            )
            raise BackendUnavailableError(_state["error"]) from exc
        return _state["module"]


def available() -> bool:
    """Whether the custom ops load (and ``DEEPREDUCE_BACKEND=numpy`` does not force NumPy)."""
    if forced_numpy():
        return False
    try:
        load()
    except BackendUnavailableError:
        return False
    return True


def unsupported(core) -> Optional[str]:
    """Why ``core``'s config cannot run as the two ops (None when it can): the C++ pipeline's
    rule (``Pipeline.native_reason``), and the ops' own limit: they hold the residuals in the
    binding, outside the core's journal, so they leave ``nonfinite: raise`` (the ranks then
    decide each step together and undo it through that journal) to the core; and the core's
    decode_sum refuses a sum that overflows, which the C++ one returns as Inf."""
    reason = core.native_reason()
    if reason is None and core.nonfinite != "propagate":
        reason = f"nonfinite: {core.nonfinite!r} (the TensorFlow ops propagate non-finite gradients)"
    return reason


def accelerator_for(core) -> Optional["PipelineOps"]:
    """The ops for ``core`` under ``backend="auto"``, or None (numpy_function path).

    None when the config does not qualify, when ``DEEPREDUCE_BACKEND=numpy``, or when the library
    does not load (then one warning says how to rebuild it; the numpy_function path writes the
    same bytes).
    """
    if unsupported(core) is not None or forced_numpy():
        return None
    try:
        module = load()
    except BackendUnavailableError as exc:
        if not _state["warned"]:
            _state["warned"] = True
            warnings.warn(f"{exc}; using tf.numpy_function over the NumPy core instead (same bytes, slower)",
                          RuntimeWarning, stacklevel=3)
        return None
    return PipelineOps(core, module)


def _int64_bits(value) -> int:
    """A float64 or uint64 as the int64 with the same bits (TF int attributes are int64)."""
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return value - (1 << 64) if value >= (1 << 63) else value


_ERROR_CLASSES = {cls.__name__: cls for cls in (errors.DeepReduceError, errors.ContainerError,
                                                errors.CommunicationError)}


def as_deepreduce_error(exc: tf.errors.OpError) -> Exception:
    """The deepreduce error an op failure stands for (its message starts with the class name)."""
    text = exc.message
    for name, cls in _ERROR_CLASSES.items():
        head = f"{name}: "
        if head in text:
            message = text[text.index(head) + len(head):]
            return cls(message.split("\n")[0].split(" [Op:")[0].strip())
    return exc


class PipelineOps:
    """Runs one core pipeline's encode and decode as the two custom ops.

    State stays in TensorFlow: one float32 residual variable per tensor name (empty until the
    tensor's first finite step, as the core's residual is absent until then), which the encode op
    updates in place, and one int64 counter vector of what the ops encoded and decoded, which
    :meth:`TFPipeline.compression_stats` adds to the core's statistics. The variables are created
    outside any ``tf.function`` being traced (``tf.init_scope``), once per name, as
    ``ResourceVariable`` objects: ``tf.Variable`` would refuse a name first met in a later trace
    ("only supports singleton tf.Variables created on the first call").
    """

    def __init__(self, core, module) -> None:
        self.core = core
        self.ops = module
        settings = core.native_settings
        self.error_feedback = settings["error_feedback"]
        attrs = {key: settings[key] for key in ("digest", "min_numel", "sparsifier", "threshold", "error_feedback",
                                                "index", "policy", "k", "value", "degree", "segments",
                                                "min_points", "coef_bytes", "threads")}
        # TF has no float64 or uint64 attributes: those travel as the int64 of the same bits
        attrs.update(ratio_bits=_int64_bits(settings["ratio"]), keys_per_block_bits=_int64_bits(settings["keys_per_block"]),
                     hash_seed=_int64_bits(settings["hash_seed"]))
        self.encode_attrs = attrs
        self._residuals: Dict[str, tf.Variable] = {}
        self._variables_lock = threading.Lock()
        with tf.init_scope(), tf.device("/cpu:0"):   # the ops run on the CPU: so does their state
            self.counters = ResourceVariable(tf.zeros([len(STATS)], tf.int64), trainable=False,
                                             name="deepreduce_op_counters")
            # the encode op's residual input without error feedback (never read)
            self._no_residual = None if self.error_feedback else self._new_residual()

    @staticmethod
    def _new_residual() -> tf.Variable:
        return ResourceVariable(tf.zeros([0], tf.float32), shape=tf.TensorShape([None]), trainable=False,
                                name="deepreduce_residual")

    @tf.autograph.experimental.do_not_convert
    def _residual(self, name: str) -> tf.Variable:
        with self._variables_lock:
            var = self._residuals.get(name)
            if var is None:
                with tf.init_scope(), tf.device("/cpu:0"):
                    var = self._new_residual()
                self._residuals[name] = var
            return var

    def residual(self, name: str) -> Optional[np.ndarray]:
        """The residual held for ``name`` (a float32 copy, flat); None before its first finite step."""
        var = self._residuals.get(name)
        if var is None or int(tf.size(var)) == 0:
            return None
        return np.array(var.numpy(), dtype=np.float32, copy=True)

    def residuals(self) -> Dict[str, np.ndarray]:
        """Every residual held (copies), by tensor name: the memory part of a checkpoint."""
        out = {}
        for name in list(self._residuals):
            residual = self.residual(name)
            if residual is not None:
                out[name] = residual
        return out

    def load_residuals(self, residuals: Dict[str, np.ndarray]) -> None:
        """Replace every residual with ``residuals`` (names absent from it start again without one)."""
        for name in set(self._residuals) | set(residuals):
            value = residuals.get(name)
            self._residual(name).assign(np.zeros(0, np.float32) if value is None else
                                        np.asarray(value, dtype=np.float32).ravel())

    @tf.autograph.experimental.do_not_convert
    def encode(self, tensor: tf.Tensor, name: str, step: tf.Tensor) -> tf.Tensor:
        """One ``DeepReduceEncode`` op (plus the addition of its counts to the counters)."""
        residual = self._residual(name) if self.error_feedback else self._no_residual
        payload, counts = self._run(self.ops.deep_reduce_encode, tensor, step, residual.handle,
                                    tensor_name=name, **self.encode_attrs)
        self.counters.assign_add(counts)
        return payload

    @tf.autograph.experimental.do_not_convert
    def decode(self, payload: tf.Tensor, shape, count: Optional[int], single: bool) -> tf.Tensor:
        """One ``DeepReduceDecode`` op: the sum of the containers (``single``: exactly one)."""
        out, counts = self._run(self.ops.deep_reduce_decode, payload, count=-1 if count is None else count,
                                single=single, shape=list(shape or ()), check_shape=shape is not None,
                                max_numel=self.core.max_numel, threads=self.core.threads)
        self.counters.assign_add(counts)
        return out

    @staticmethod
    def _run(op, *args, **attrs):
        if not tf.executing_eagerly():
            return op(*args, **attrs)
        try:
            return op(*args, **attrs)
        except tf.errors.OpError as exc:   # eagerly, the deepreduce error class the op named
            raise as_deepreduce_error(exc) from None

    def counts(self) -> dict:
        """What the ops encoded and decoded so far, in :class:`~deepreduce.CompressionStats` terms."""
        values = dict(zip(STATS, (int(v) for v in self.counters.numpy())))
        out = {key: values[key] for key in STATS[:8]}
        out["encode_seconds"] = values["encode_ns"] / 1e9
        out["decode_seconds"] = values["decode_ns"] / 1e9
        return out
