"""The TensorFlow custom ops: one op encodes a tensor, one op decodes (and sums) containers.

``scripts/build_tf_ops.sh`` compiles ``csrc/tf/tf_pipeline_ops.cpp`` with every pure C++ source
of ``csrc/`` (the Top-r/compensation kernels, the Bloom kernels and the container code the
pybind11 extensions wrap) into ``deepreduce/tensorflow/_deepreduce_ops.so``; ``make setup`` runs it.

* ``DeepReduceEncode`` is ``Pipeline.encode`` for one gradient: error feedback fused with the
  Top-r selection (or followed by threshold selection), the raw or Bloom index codec (every policy), the raw, fp16 or polyfit value
  codec (with its permutation) and the container, header and CRC included.
* ``DeepReduceDecode`` is ``Pipeline.decode_sum`` (or ``decode``) over an allgather result.

They serve the configs whose every stage exists in C++ (:func:`unsupported` says why another
config does not qualify); every other config runs its encode and its decode as one
``tf.numpy_function`` stage each over the core (see :mod:`.pipeline`). Nothing here restates a
codec: the attributes of the ops come from the core pipeline's components.

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
from ..index import bloom as bloom_codec
from ..memory import ResidualMemory
from ..sparsify.basic import TopK
from ..sparsify.threshold import ThresholdSparsifier

LIBRARY_NAME = "_deepreduce_ops.so"
LIBRARY_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY_NAME)
REBUILD_HINT = (
    "rebuild the TensorFlow custom ops against the installed TensorFlow with "
    "`bash scripts/build_tf_ops.sh` (or `make setup`) from the deepreduce project root"
)
OPS_INDEX_CODECS = ("raw", "bloom")
OPS_VALUE_CODECS = ("raw", "fp16", "polyfit")
OPS_MEMORIES = ("none", "residual")
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
    """Why ``core``'s config cannot run as the two ops (None when it can)."""
    if type(core.sparsifier) not in (TopK, ThresholdSparsifier):
        return f"sparsifier {core.sparsifier.id!r} (the ops select Top-r or by threshold)"
    if core.index.id not in OPS_INDEX_CODECS:
        return f"index codec {core.index.id!r} (the ops have {', '.join(OPS_INDEX_CODECS)})"
    if core.value.id not in OPS_VALUE_CODECS:
        return f"value codec {core.value.id!r} (the ops have {', '.join(OPS_VALUE_CODECS)})"
    if core.memory.id not in OPS_MEMORIES:
        return f"memory {core.memory.id!r} (the ops have {', '.join(OPS_MEMORIES)})"
    if core.nonfinite != "propagate":
        # the ranks then decide each step together and undo it through the core's journal
        # (deepreduce.dist.agreement), which holds the core's residuals, not the ops' variables
        return f"nonfinite: {core.nonfinite!r} (the ops propagate non-finite gradients)"
    return None


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
    tensor's first finite step, as the core's residual is absent until then) and one int64
    counter vector of what the ops encoded and decoded, which
    :meth:`TFPipeline.compression_stats` adds to the core's statistics. The variables are created
    outside any ``tf.function`` being traced (``tf.init_scope``), once per name, as
    ``ResourceVariable`` objects: ``tf.Variable`` would refuse a name first met in a later trace
    ("only supports singleton tf.Variables created on the first call").
    """

    def __init__(self, core, module) -> None:
        self.core = core
        self.ops = module
        self.error_feedback = isinstance(core.memory, ResidualMemory)
        index = core.index
        attrs = dict(
            digest=core.config_digest, min_numel=core.min_numel, sparsifier=core.sparsifier.id, error_feedback=self.error_feedback,
            index=index.id, value=core.value.id, threads=core.threads,
        )
        if core.sparsifier.id == "topk":
            attrs.update(ratio_bits=_int64_bits(float(core.sparsifier.ratio)))
        else:   # compared in float32, as threshold_positions does
            attrs.update(threshold=float(np.float32(core.sparsifier.threshold)))
        if index.id == "bloom":
            lam, k = bloom_codec.filter_shape(index.fpr)
            attrs.update(policy=index.policy, keys_per_block_bits=_int64_bits(float(lam)), k=k,
                         hash_seed=_int64_bits(index.hash_seed))
        if core.value.id == "polyfit":
            value = core.value
            attrs.update(degree=value.degree, segments=value.segments, min_points=value.min_points,
                         coef_bytes=value.coef_bytes)
        self.encode_attrs = attrs
        self._residuals: Dict[str, tf.Variable] = {}
        self._variables_lock = threading.Lock()
        with tf.init_scope(), tf.device("/cpu:0"):   # the ops run on the CPU: so does their state
            self.counters = ResourceVariable(tf.zeros([len(STATS)], tf.int64), trainable=False,
                                             name="deepreduce_op_counters")

    @tf.autograph.experimental.do_not_convert
    def _residual(self, name: str) -> tf.Variable:
        with self._variables_lock:
            var = self._residuals.get(name)
            if var is None:
                with tf.init_scope(), tf.device("/cpu:0"):
                    var = ResourceVariable(tf.zeros([0], tf.float32), shape=tf.TensorShape([None]),
                                           trainable=False, name="deepreduce_residual")
                self._residuals[name] = var
            return var

    def residual(self, name: str) -> Optional[np.ndarray]:
        """The residual held for ``name`` (float32, flat); None before its first finite step."""
        var = self._residuals.get(name)
        if var is None or int(tf.size(var)) == 0:
            return None
        return var.numpy()

    @tf.autograph.experimental.do_not_convert
    def encode(self, tensor: tf.Tensor, name: str, step: tf.Tensor) -> tf.Tensor:
        """One ``DeepReduceEncode`` op (plus the assignment of its new residual and counters)."""
        residual = self._residual(name) if self.error_feedback else None
        current = residual.read_value() if residual is not None else tf.zeros([0], tf.float32)
        payload, new_residual, counts = self._run(self.ops.deep_reduce_encode, tensor, step, current,
                                                  tensor_name=name, **self.encode_attrs)
        if residual is not None:
            residual.assign(new_residual)
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
