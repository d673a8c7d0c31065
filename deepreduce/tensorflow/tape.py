"""``DistributedGradientTape``: Horovod's tape, with gradients sent as DeepReduce containers.

Usage (Horovod's TF2 pattern: the wrapper is created inside the step, eager or compiled)::

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = deepreduce.tensorflow.DistributedGradientTape(tape, compression="configs/topk_raw.yaml")
        grads = tape.gradient(loss, model.trainable_variables)
        ...

It takes the arguments of ``horovod.tensorflow.DistributedGradientTape``. ``compression`` is a
deepreduce config (YAML path, dict, core or TF pipeline): a path, dict or core pipeline
resolves to one pipeline per config in the process (see :func:`.pipeline.shared`), so the
residuals and the step counter survive the per-step wrapper. A summable compressor (Horovod's
``hvd.Compression.none``/``fp16``, :class:`deepreduce.tensorflow.GradiVeQ`) goes through
``hvd.allreduce``.
"""
from __future__ import annotations

import tensorflow as tf

from ..collective import buckets
from .collectives import is_summable_compressor
from .pipeline import TFPipeline, shared
from .reduce import Reducer
from .sparse import refuse_sparse_tensors


def _source_key(source):
    ref = getattr(source, "ref", None)
    return ref() if callable(ref) else id(source)


def make_reducer(compression, **kwargs) -> Reducer:
    """A Reducer: containers by allgather for a deepreduce config, Horovod allreduce otherwise.

    A config path, dict or core pipeline resolves to its process-wide pipeline
    (:func:`~deepreduce.tensorflow.pipeline.shared`), so a tape created at every step, or inside
    every trace of a ``tf.function``, keeps one set of residuals and one step counter.
    """
    if compression is None or is_summable_compressor(compression):
        return Reducer(None, hvd_compression=compression, **kwargs)
    return Reducer(shared(compression), **kwargs)


class _DeepReduceGradientTape(tf.GradientTape):
    """A ``tf.GradientTape`` sharing the recorded tape of another, reducing in ``gradient``."""

    def __init__(self, tape: tf.GradientTape, reducer: Reducer, step, scale_local_gradients: bool,
                 prefix: str) -> None:
        super().__init__(persistent=tape._persistent,
                         watch_accessed_variables=getattr(tape, "_watch_accessed_variables", True))
        self.__dict__.update(tape.__dict__)   # the recorded tape, persistence and watched variables
        self._deepreduce = reducer
        self._step = step
        self._prefix = prefix
        self.scale_local_gradients = scale_local_gradients
        self.process_set = reducer.process_set
        self._local_sources = set()

    @property
    def pipeline(self) -> TFPipeline:
        return self._deepreduce.pipeline

    def compression_stats(self) -> dict:
        """The pipeline's (or summable compressor's) running statistics; see :meth:`Reducer.compression_stats`."""
        return self._deepreduce.compression_stats()

    def register_local_source(self, source) -> None:
        """Mark a source as worker-local: its gradient is not communicated (Horovod semantics)."""
        self._local_sources.add(_source_key(source))

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        positions = [i for i, s in enumerate(flat_sources) if _source_key(s) not in self._local_sources]
        refuse_sparse_tensors([flat_grads[i] for i in positions], [f"{self._prefix}_{i}" for i in positions])
        reduced = self._deepreduce.reduce(
            [flat_grads[i] for i in positions], [f"{self._prefix}_{i}" for i in positions], step=self._step)
        out = list(flat_grads)
        for i, g in zip(positions, reduced):
            out[i] = g
        if self.scale_local_gradients and self._local_sources:
            size = float(self._deepreduce.size)
            for i, s in enumerate(flat_sources):
                if _source_key(s) in self._local_sources and out[i] is not None:
                    g = out[i]
                    if isinstance(g, tf.IndexedSlices):
                        out[i] = tf.IndexedSlices(g.values / tf.cast(size, g.values.dtype), g.indices, g.dense_shape)
                    else:
                        out[i] = g / tf.cast(size, g.dtype)
        return tf.nest.pack_sequence_as(sources, out)


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=None,
                            sparse_as_dense=False, op=None, gradient_predivide_factor=1.0,
                            num_groups=0, groups=None, process_set=None, scale_local_gradients=True,
                            *, step=None, name_prefix="grad", background=True, bucket_cap_mb=None):
    """Wrap ``gradtape`` so that ``gradient()`` returns gradients averaged (or summed) over ranks.

    Args (beyond Horovod's, which keep their meaning):
        compression: a deepreduce config (path, dict) or a pipeline built once with
            :func:`deepreduce.tensorflow.build`; or None / a Horovod compressor
            (``hvd.Compression.none``/``fp16``), in which case the gradients are reduced by
            ``hvd.allreduce`` (any Horovod ``op``), the uncompressed baseline.
        step: the step used to seed randomised components: an int, an integer tensor or a
            variable such as ``optimizer.iterations``. None: the pipeline's own counter
            (``pipeline.iterations``), advanced by one per ``gradient()`` call.
        name_prefix: tensors are named ``f"{name_prefix}_{i}"`` by position in ``sources``, the
            same on every rank; use another prefix when one step calls ``gradient()`` for
            different variable lists.
        background: eagerly, run each tensor's encode -> allgather -> decode on worker threads
            (``True``: :data:`deepreduce.collective.overlap.DEFAULT_WORKERS` of them; an int: that many), so
            encodes overlap other tensors' communication; ``False``: one tensor after another.
            Same containers and gradients either way; no effect inside ``tf.function``.
        bucket_cap_mb: None (default): one container per gradient; a number of MiB: the float32
            gradients with at least the config's ``min_numel`` elements travel concatenated, one
            container per bucket of at most that size (see ``deepreduce.collective.buckets``; a sparsifier
            then selects over the bucket).

    ``device_dense``/``device_sparse`` are accepted for compatibility: containers are built on
    the host. ``num_groups``/``groups`` are refused with a ``ConfigError``
    (:func:`deepreduce.collective.buckets.refuse_groups`: use ``bucket_cap_mb``). An ``IndexedSlices``
    gradient (an embedding lookup's) travels as its touched rows' entries and comes back as an
    ``IndexedSlices`` of every rank's touched rows (:mod:`deepreduce.tensorflow.sparse`), as
    Horovod's allgather of its parts; it is made dense first with ``sparse_as_dense=True``, with a
    config that keeps a residual (error feedback needs the whole tensor) and under the sparse
    all-reduce.
    """
    buckets.refuse_groups(num_groups, groups, "DistributedGradientTape")
    reducer = make_reducer(compression, op=op, process_set=process_set,
                           gradient_predivide_factor=gradient_predivide_factor, sparse_as_dense=sparse_as_dense,
                           background=background, bucket_cap_mb=bucket_cap_mb)
    return _DeepReduceGradientTape(gradtape, reducer, step, scale_local_gradients, name_prefix)
