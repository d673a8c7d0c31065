"""``DistributedOptimizer``: Horovod's optimizer wrapper, with gradients sent as DeepReduce containers.

For a Keras 3 optimizer the result is an optimizer of the same class whose ``apply`` (and so
``apply_gradients`` and ``model.fit``'s update) first reduces the gradients across ranks; the
step that seeds randomised components is the optimizer's own ``iterations``. With
``backward_passes_per_step = N > 1`` the gradients of N calls are summed locally (in
optimizer variables) and reduced and applied on every N-th call only, as Horovod does. For a
legacy ``tf.compat.v1.train.Optimizer`` the gradients are reduced in ``compute_gradients``.
Horovod's ``horovod.tensorflow.keras`` wrapper does not work with Keras 3 (its variables
lack ``.ref``); this one uses only Horovod's public ``allgather``/``allreduce``.
"""
from __future__ import annotations

import tensorflow as tf

from ..collective import buckets, overlap
from ..errors import ConfigError
from .collectives import import_horovod, is_summable_compressor
from .pipeline import build
from .reduce import Reducer
from .sparse import refuse_sparse_tensors


def _keras_wrapper_class(base):
    """A subclass of a Keras optimizer class whose ``apply`` reduces the gradients first."""

    def build_variables(self, variables):
        if self.built:
            return
        base.build(self, variables)
        if self._deepreduce_passes > 1:
            # the local sums of the gradients of the passes since the last reduction
            self._deepreduce_sums = [self.add_variable_from_reference(v, name="deepreduce_gradient_sum")
                                     for v in variables]
            self._deepreduce_passes_done = self.add_variable((), initializer="zeros", dtype="int64",
                                                             name="deepreduce_passes_done")

    def reduce_and_apply(self, grads, trainable_variables):
        names = [f"{self._deepreduce_prefix}_{i}" for i in range(len(grads))]
        reduced = self._deepreduce_reducer.reduce(grads, names, step=tf.convert_to_tensor(self.iterations))
        return base.apply(self, reduced, trainable_variables)

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        refuse_sparse_tensors(grads, [f"{self._deepreduce_prefix}_{i}" for i in range(len(grads))])
        passes = self._deepreduce_passes
        if passes == 1:
            return reduce_and_apply(self, grads, trainable_variables)
        if not self.built:
            if trainable_variables is None:
                raise ConfigError("DistributedOptimizer.apply: pass the variables on the first call "
                                  "(or build the optimizer first)")
            self.build(list(trainable_variables))
        sums = self._deepreduce_sums
        for total, g in zip(sums, grads):
            if g is not None:
                total.assign_add(tf.convert_to_tensor(g))
        done = self._deepreduce_passes_done
        done.assign_add(1)

        def communicate():
            scale = 1.0 / passes if self._deepreduce_average_passes else 1.0
            summed = [None if g is None else tf.convert_to_tensor(s) * tf.cast(scale, s.dtype)
                      for s, g in zip(sums, grads)]
            reduce_and_apply(self, summed, trainable_variables)
            for total in sums:
                total.assign(tf.zeros_like(total))
            done.assign(0)
            return tf.constant(True)

        tf.cond(tf.equal(tf.convert_to_tensor(done), passes), communicate, lambda: tf.constant(False))

    def compression_stats(self) -> dict:
        """Bytes before and after compression, encode/decode time (see ``Reducer.compression_stats``)
        and the number of reductions applied so far (``steps``)."""
        stats = self._deepreduce_reducer.compression_stats()
        stats["steps"] = int(tf.convert_to_tensor(self.iterations))
        return stats

    return type(base.__name__, (base,), {
        "build": build_variables,
        "apply": apply,
        "compression_stats": compression_stats,
        "__doc__": f"{base.__name__} whose gradients are reduced across ranks by deepreduce.",
    })


class _LegacyDistributedOptimizer(tf.compat.v1.train.Optimizer):
    """Wraps a ``tf.compat.v1.train.Optimizer``: ``compute_gradients`` returns reduced gradients."""

    def __init__(self, optimizer, reducer: Reducer, name: str, use_locking: bool, prefix: str) -> None:
        super().__init__(use_locking=use_locking, name=name)
        self._optimizer = optimizer
        self._deepreduce_reducer = reducer
        self._deepreduce_prefix = prefix

    def compute_gradients(self, *args, **kwargs):
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = zip(*pairs) if pairs else ((), ())
        names = [f"{self._deepreduce_prefix}_{i}" for i in range(len(grads))]
        refuse_sparse_tensors(grads, names)
        # step: the pipeline's own counter, advanced once per compute_gradients call
        return list(zip(self._deepreduce_reducer.reduce(list(grads), names, step=None), variables))

    def apply_gradients(self, *args, **kwargs):
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)

    def compression_stats(self) -> dict:
        """Bytes before and after compression and encode/decode time of the pipeline."""
        return self._deepreduce_reducer.compression_stats()


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=None, sparse_as_dense=False, backward_passes_per_step=1, op=None,
                         gradient_predivide_factor=1.0, average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=None, scale_local_gradients=True, *, name_prefix="grad",
                         background=True, bucket_cap_mb=None):
    """An optimizer that averages (or sums) gradients across ranks before applying them.

    Takes the arguments of ``horovod.tensorflow.DistributedOptimizer``. ``compression`` is a
    deepreduce config (path or dict: this optimizer builds its own pipeline once, at
    construction) or a pipeline built with :func:`deepreduce.tensorflow.build`; ``None``, a
    Horovod compressor or another summable compressor (:class:`deepreduce.tensorflow.GradiVeQ`)
    reduces by ``hvd.allreduce`` (Horovod's own wrapper for a legacy v1 optimizer; for Keras 3,
    where Horovod's Keras wrapper fails, this module's). Gradients are named
    ``f"{name_prefix}_{i}"`` by position.

    ``backward_passes_per_step`` (Keras optimizers; legacy ones through Horovod's own wrapper
    when no deepreduce config is given): gradients of that many ``apply`` calls are summed
    locally, then reduced and applied once (divided by the count when
    ``average_aggregated_gradients``); ``iterations`` counts the applied steps.
    ``background``: as for :func:`~deepreduce.tensorflow.DistributedGradientTape` (eager
    reductions run each tensor's chain on worker threads unless ``False``); ``bucket_cap_mb``:
    as for the tape (gradients in buckets of at most that many MiB, one container each).
    ``device_*`` are accepted for compatibility and have no effect here; ``num_groups``/``groups``
    are passed to Horovod's own wrapper where it takes over (legacy optimizer, no deepreduce
    config) and refused otherwise (:func:`deepreduce.collective.buckets.refuse_groups`).
    For a Keras optimizer a new optimizer of the same class and config is returned (its state
    starts empty, as with Horovod's Keras wrapper).
    """
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ConfigError(f"DistributedOptimizer: backward_passes_per_step must be a positive integer, "
                          f"got {backward_passes_per_step!r}")
    overlap.check_workers(background, "DistributedOptimizer")   # also where Horovod's wrapper takes over
    summable = compression is None or is_summable_compressor(compression)
    buckets.check_bucket_cap_for(bucket_cap_mb, summable, "DistributedOptimizer")   # before Horovod's wrapper
    if summable and isinstance(optimizer, tf.compat.v1.train.Optimizer):
        hvd = import_horovod()
        return hvd.DistributedOptimizer(
            optimizer, name=name, use_locking=use_locking, device_dense=device_dense, device_sparse=device_sparse,
            compression=compression or hvd.Compression.none, sparse_as_dense=sparse_as_dense,
            backward_passes_per_step=backward_passes_per_step,
            op=hvd.Average if op is None else op, gradient_predivide_factor=gradient_predivide_factor,
            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
            process_set=hvd.global_process_set if process_set is None else process_set,
            scale_local_gradients=scale_local_gradients)
    buckets.refuse_groups(num_groups, groups, "DistributedOptimizer")
    kwargs = dict(op=op, process_set=process_set, gradient_predivide_factor=gradient_predivide_factor,
                  sparse_as_dense=sparse_as_dense, background=background, bucket_cap_mb=bucket_cap_mb)
    reducer = Reducer(None, hvd_compression=compression, **kwargs) if summable else \
        Reducer(build(compression), **kwargs)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if backward_passes_per_step != 1:
            raise ConfigError(
                f"backward_passes_per_step={backward_passes_per_step} with a deepreduce config needs a Keras "
                "optimizer; a tf.compat.v1 optimizer communicates every step with a config"
            )
        return _LegacyDistributedOptimizer(optimizer, reducer, name or f"Distributed{type(optimizer).__name__}",
                                           use_locking, name_prefix)
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigError(
            f"DistributedOptimizer wraps a keras.optimizers.Optimizer or a tf.compat.v1.train.Optimizer, "
            f"got {type(optimizer).__name__}"
        )
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    wrapped = _keras_wrapper_class(type(optimizer)).from_config(config)
    wrapped._deepreduce_reducer = reducer
    wrapped._deepreduce_prefix = name_prefix
    wrapped._deepreduce_passes = backward_passes_per_step
    wrapped._deepreduce_average_passes = bool(average_aggregated_gradients)
    return wrapped
