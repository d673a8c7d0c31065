"""How the TensorFlow binding reaches Horovod: its import, its reduce ops, names and allgathers.

The reducer (:mod:`deepreduce.tensorflow.reduce`), the optimizers and the Keras helpers call
Horovod's public TensorFlow API only (Horovod itself is never patched). Every collective of the
binding is named by :func:`tensor_key`, which is how Horovod matches it across ranks whatever
order they submit it in; :func:`gather` keeps that name for eager allgathers too.
"""
from __future__ import annotations

import re

import tensorflow as tf

from ..errors import BackendUnavailableError, ConfigError

_EAGER_GATHERS = {}   # (process set, tensor key) -> concrete function of one named allgather (see gather)


def import_horovod():
    """``horovod.tensorflow``, or BackendUnavailableError saying how to build it."""
    try:
        import horovod.tensorflow as hvd
    except ImportError as exc:
        raise BackendUnavailableError(
            f"deepreduce.tensorflow's distributed wrappers need horovod.tensorflow: {exc}. "
            "Run `make setup` to build the patched Horovod."
        ) from exc
    return hvd


def is_summable_compressor(compression) -> bool:
    """True for a Horovod-style compressor whose output an allreduce can sum.

    Horovod's own (``hvd.Compression.none``/``fp16``, classes with static methods) and any
    object with ``compress``/``decompress`` methods, such as :class:`deepreduce.tensorflow.GradiVeQ`.
    """
    return callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))


def resolve_op(op):
    """Horovod's reduce op -> ``"average"`` or ``"sum"`` (Adasum/Min/Max cannot be sent as containers)."""
    hvd = import_horovod()
    if op is None or op == hvd.Average:
        return "average"
    if op == hvd.Sum:
        return "sum"
    raise ConfigError(
        f"deepreduce reduces gradients with op=hvd.Average or op=hvd.Sum; got {op!r} "
        "(Adasum, Min, Max and Product need an allreduce of the raw gradient)"
    )


def tensor_key(name: str) -> str:
    """A Horovod tensor / TF op name for a deepreduce tensor name (same on every rank)."""
    return "DeepReduce_" + re.sub(r"[^A-Za-z0-9_.\-]", "_", name)


def gather(name: str, payload: tf.Tensor, process_set) -> tf.Tensor:
    """Every rank's payload of ``name`` in ``process_set``, concatenated: ``hvd.allgather`` named
    :func:`tensor_key`.

    Eagerly, through a traced ``tf.function`` made once per tensor and process set. An eager op
    carries no node name, and Horovod takes the kernel's: every eager allgather gets the same one,
    so eager collectives meet across ranks by order alone, and a second one while the first is in
    flight fails ("a tensor with the same name as another tensor that is currently being
    processed", even with different ``name=``). Inside a function the op has its graph name, so
    concurrent gathers of different tensors are told apart and every rank's gather of a tensor
    meets the same name whatever order they run in (Horovod's own tape, too, runs its eager
    reductions as a ``tf.function``).
    """
    hvd, key = import_horovod(), tensor_key(name)
    if not tf.executing_eagerly():
        return hvd.allgather(payload, name=key, process_set=process_set)
    traced = _EAGER_GATHERS.get((id(process_set), key))
    if traced is None:
        def allgather(tensor):
            return hvd.allgather(tensor, name=key, process_set=process_set)

        # traced here, once; calling the concrete function never retraces (nor warns that it did)
        traced = _EAGER_GATHERS.setdefault((id(process_set), key), tf.function(
            allgather, autograph=False).get_concrete_function(tf.TensorSpec([None], tf.uint8)))
    return traced(payload)
