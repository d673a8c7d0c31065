"""``DistributedOptimizer``: Horovod's optimizer wrapper, with gradients sent as DeepReduce containers.

For a Keras 3 optimizer the result is an optimizer of the same class whose ``apply`` (and so
``apply_gradients`` and ``model.fit``'s update) first reduces the gradients across ranks; the
step that seeds randomised components is the optimizer's own ``iterations``. For a legacy
``tf.compat.v1.train.Optimizer`` the gradients are reduced in ``compute_gradients``.
Horovod's ``horovod.tensorflow.keras`` wrapper does not work with Keras 3 (its variables
lack ``.ref``); this one uses only Horovod's public ``allgather``.
"""
from __future__ import annotations

import tensorflow as tf

from ..errors import ConfigError
from .reduce import Reducer, import_horovod, is_horovod_compressor
from .tape import make_reducer


def _keras_wrapper_class(base):
    """A subclass of a Keras optimizer class whose ``apply`` reduces the gradients first."""

    def apply(self, grads, trainable_variables=None):
        reducer = self._deepreduce_reducer
        grads = list(grads)
        names = [f"{self._deepreduce_prefix}_{i}" for i in range(len(grads))]
        reduced = reducer.reduce(grads, names, step=tf.convert_to_tensor(self.iterations))
        return base.apply(self, reduced, trainable_variables)

    return type(base.__name__, (base,), {
        "apply": apply,
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


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=None, sparse_as_dense=False, backward_passes_per_step=1, op=None,
                         gradient_predivide_factor=1.0, average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=None, scale_local_gradients=True, *, name_prefix="grad"):
    """An optimizer that averages (or sums) gradients across ranks before applying them.

    Takes the arguments of ``horovod.tensorflow.DistributedOptimizer``. ``compression`` is a
    deepreduce config or a pipeline built once with :func:`deepreduce.tensorflow.build`;
    ``None`` or a Horovod compressor reduces by ``hvd.allreduce`` (Horovod's own wrapper for a
    legacy v1 optimizer; for Keras 3, where Horovod's Keras wrapper fails, this module's). Gradients are named
    ``f"{name_prefix}_{i}"`` by position. ``backward_passes_per_step`` must be 1 (local
    gradient accumulation is not implemented for containers); ``device_*``, ``groups`` and
    ``average_aggregated_gradients`` are accepted for compatibility and have no effect here.
    For a Keras optimizer a new optimizer of the same class and config is returned (its state
    starts empty, as with Horovod's Keras wrapper).
    """
    if backward_passes_per_step != 1:
        raise ConfigError(
            f"backward_passes_per_step={backward_passes_per_step}: deepreduce's DistributedOptimizer "
            "communicates every step (set it to 1, or accumulate gradients before apply)"
        )
    if (compression is None or is_horovod_compressor(compression)) and \
            isinstance(optimizer, tf.compat.v1.train.Optimizer):
        hvd = import_horovod()
        return hvd.DistributedOptimizer(
            optimizer, name=name, use_locking=use_locking, device_dense=device_dense, device_sparse=device_sparse,
            compression=compression or hvd.Compression.none, sparse_as_dense=sparse_as_dense,
            op=hvd.Average if op is None else op, gradient_predivide_factor=gradient_predivide_factor,
            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
            process_set=hvd.global_process_set if process_set is None else process_set,
            scale_local_gradients=scale_local_gradients)
    reducer = make_reducer(compression, "DistributedOptimizer", op=op, process_set=process_set,
                           gradient_predivide_factor=gradient_predivide_factor, sparse_as_dense=sparse_as_dense)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
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
    return wrapped
