"""Gradient reduction through DeepReduce containers and ``hvd.allgather``.

Every rank encodes its gradient with (name, step) into one container, the containers of all
ranks travel by Horovod's public ``allgather`` (they differ in size and are not summable, so
allreduce cannot carry them), and every rank splits the gathered bytes, decodes each
container, sums, and divides by the number of ranks for ``op=Average``. Every stage is a graph
op, so the same code runs eagerly and inside ``tf.function`` (where Horovod and the tape's
reduction code run only while the graph is traced). Horovod itself is never patched.
"""
from __future__ import annotations

import re
from typing import List, Optional, Sequence

import tensorflow as tf

from ..errors import BackendUnavailableError, ConfigError
from .pipeline import TFPipeline, build


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


class Reducer:
    """Averages or sums a list of gradients across the ranks of one Horovod process set.

    With a deepreduce pipeline, each gradient travels as a container by ``hvd.allgather``.
    With ``pipeline=None`` it travels by ``hvd.allreduce`` with the given summable compressor
    (``hvd.Compression.none``/``fp16``, the uncompressed baseline, or GradiVeQ), which also
    works with Keras 3 variables (Horovod's own wrappers call ``Variable.ref``, which Keras 3
    removed).

    Holds no per-step state: the pipeline owns residuals, statistics and the step counter, so a
    new tape each step (the Horovod idiom) keeps using the same state.
    """

    def __init__(self, pipeline: Optional[TFPipeline], op=None, process_set=None,
                 gradient_predivide_factor: float = 1.0, sparse_as_dense: bool = False,
                 hvd_compression=None) -> None:
        self.hvd = import_horovod()
        self.pipeline = None if pipeline is None else build(pipeline)
        self.hvd_compression = hvd_compression if hvd_compression is not None else self.hvd.Compression.none
        if self.pipeline is not None:
            self.op = resolve_op(op)
            self.hvd_op = self.hvd.Average if self.op == "average" else self.hvd.Sum
        else:
            self.hvd_op = self.hvd.Average if op is None else op
            self.op = "average" if self.hvd_op == self.hvd.Average else "other"
        self.process_set = process_set if process_set is not None else self.hvd.global_process_set
        if gradient_predivide_factor != 1.0 and self.op != "average":
            raise ConfigError("gradient_predivide_factor is only supported with op=hvd.Average")
        if not gradient_predivide_factor > 0:
            raise ConfigError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor!r}")
        self.predivide = float(gradient_predivide_factor)
        self.sparse_as_dense = sparse_as_dense

    def compression_stats(self) -> dict:
        """The pipeline's running statistics (bytes, encode/decode time), or the summable
        compressor's ``compression_stats()`` where it has one; empty for Horovod's compressors."""
        if self.pipeline is not None:
            return self.pipeline.compression_stats()
        stats = getattr(self.hvd_compression, "compression_stats", None)
        return stats() if callable(stats) else {}

    @property
    def size(self) -> int:
        return self.process_set.size()

    def _process_set_kwargs(self) -> dict:
        if self.process_set is self.hvd.global_process_set:
            return {}
        return {"process_set": self.process_set}

    def reduce_one(self, grad, name: str, step) -> tf.Tensor:
        """The average (or sum) over ranks of one gradient tensor."""
        if isinstance(grad, tf.IndexedSlices):
            # containers (and the baseline allreduce) carry dense tensors; the sparsifier finds
            # the non-zeros again
            grad = tf.convert_to_tensor(grad)
        if self.pipeline is None:
            kwargs = self._process_set_kwargs()
            if self.predivide != 1.0:
                kwargs.update(prescale_factor=1.0 / self.predivide, postscale_factor=self.predivide)
            return self.hvd.allreduce(grad, op=self.hvd_op, compression=self.hvd_compression,
                                      name=tensor_key(name), **kwargs)
        dtype = grad.dtype
        size = self.size
        if self.predivide != 1.0:
            grad = grad * tf.cast(1.0 / self.predivide, dtype)
        payload = self.pipeline.encode(grad, name=name, step=step)
        gathered = self.hvd.allgather(payload, name=tensor_key(name), **self._process_set_kwargs())
        shape = grad.shape if grad.shape.is_fully_defined() else None
        total = self.pipeline.decode_sum(gathered, shape, count=size)
        if shape is None:
            total = tf.reshape(total, tf.shape(grad))
        if self.op == "average":
            total = total * (self.predivide / size)
        return tf.cast(total, dtype) if dtype != tf.float32 else total

    def reduce(self, grads: Sequence, names: Sequence[str], step=None) -> List[Optional[tf.Tensor]]:
        """Reduce a list of gradients (None entries stay None).

        ``step``: an int, an integer tensor or variable (e.g. ``optimizer.iterations``); when
        None, the pipeline's own counter is read and then advanced by one.
        """
        own_counter = step is None and self.pipeline is not None
        if own_counter:
            counter = self.pipeline.iterations
            step = tf.identity(counter.read_value())
        elif step is not None and hasattr(step, "dtype") and not isinstance(step, tf.Tensor):
            step = tf.convert_to_tensor(step)  # a (Keras) variable: read it once, before the update
        out = [None if g is None else self.reduce_one(g, n, step) for g, n in zip(grads, names)]
        if own_counter:
            done = [g for g in out if g is not None]
            with tf.control_dependencies(done):
                counter.assign_add(1)
        return out
