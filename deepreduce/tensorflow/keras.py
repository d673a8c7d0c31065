"""Keras 3 pieces for data-parallel training under Horovod: what ``horovod.tensorflow.keras`` offers.

Horovod 0.28.1's Keras module does not work with Keras 3: its ``BroadcastGlobalVariablesCallback``
calls ``Variable.ref`` (Keras 3 variables have none) and ``horovod.tensorflow.broadcast_variables``
ends in ``'SymbolicTensor' object has no attribute 'assign'``. This module gives working
equivalents that use only Horovod's public ``broadcast``/``allreduce``::

    import deepreduce.tensorflow.keras as drk
    optimizer = drk.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="configs/topk_raw.yaml")
    model.compile(optimizer=optimizer, loss=...)
    model.fit(x, y, callbacks=[drk.BroadcastGlobalVariablesCallback(0), drk.MetricAverageCallback()])

Import it explicitly (``deepreduce.tensorflow`` does not import Keras callbacks on its own).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import keras
import numpy as np
import tensorflow as tf

from ..errors import ConfigError
from .collectives import import_horovod
from .optimizer import DistributedOptimizer

__all__ = ["broadcast_variables", "BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "DistributedOptimizer"]


def _process_set_kwargs(process_set) -> dict:
    return {} if process_set is None else {"process_set": process_set}


def broadcast_variables(variables: Iterable, root_rank: int = 0, process_set=None, name: str = "variables") -> None:
    """Give every variable the value it has on ``root_rank`` (Keras 3 or ``tf.Variable``s).

    Runs eagerly: the variables of one dtype travel together in one ``hvd.broadcast`` (a flat
    concatenation, split and assigned back), so a model costs one collective per dtype. Every
    rank must pass variables of the same shapes and dtypes in the same order.
    """
    hvd = import_horovod()
    variables = list(variables)
    by_dtype = defaultdict(list)
    values = [tf.convert_to_tensor(v) for v in variables]
    for i, value in enumerate(values):
        by_dtype[value.dtype].append(i)
    for dtype in sorted(by_dtype, key=lambda d: d.name):
        positions = by_dtype[dtype]
        flat = tf.concat([tf.reshape(values[i], [-1]) for i in positions], axis=0)
        flat = hvd.broadcast(flat, root_rank=root_rank, name=f"DeepReduce_broadcast_{name}_{dtype.name}",
                             **_process_set_kwargs(process_set))
        offset = 0
        for i in positions:
            size = int(np.prod(values[i].shape))
            variables[i].assign(tf.reshape(flat[offset:offset + size], values[i].shape))
            offset += size


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, set the model's and optimizer's variables to ``root_rank``'s.

    ``model.fit`` builds the model and the optimizer before calling ``on_train_begin``, so every
    rank takes its first step from the same weights and optimizer state (Horovod's callback
    broadcasts only after the first batch).

    Horovod's arguments: ``device`` is accepted for compatibility (the broadcast runs where the
    variables are); ``local_variables`` (a variable or a collection of them) stay as each rank
    has them, as Horovod's ``register_local_var``. ``process_set``: broadcast within that set.
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None, process_set=None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        if local_variables is None:
            local_variables = []
        elif isinstance(local_variables, (tf.Variable, keras.Variable)):
            local_variables = [local_variables]
        local_variables = list(local_variables)
        if not all(isinstance(v, (tf.Variable, keras.Variable)) for v in local_variables):
            raise ConfigError("BroadcastGlobalVariablesCallback: local_variables must be variables "
                              "(tf.Variable or keras.Variable), or a collection of them")
        self._local = {id(v) for v in local_variables}
        self.broadcast_done = False

    def on_train_begin(self, logs=None) -> None:
        if self.broadcast_done:
            return
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            variables += list(optimizer.variables)
        variables = [v for v in variables if id(v) not in self._local]
        broadcast_variables(variables, self.root_rank, self.process_set, name="global_variables")
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """At each epoch's end, replace every numeric entry of the logs by its average over ranks.

    Put it before callbacks that read the logs (checkpointing, printing, early stopping) so
    they see the averaged values; all keys travel in one ``hvd.allreduce``.
    """

    def __init__(self, process_set=None) -> None:
        super().__init__()
        self.process_set = process_set

    def on_epoch_end(self, epoch, logs=None) -> None:
        if not logs:
            return
        hvd = import_horovod()
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number))
        if not keys:
            return
        values = tf.constant([float(logs[k]) for k in keys], tf.float64)
        averaged = hvd.allreduce(values, op=hvd.Average, name="DeepReduce_metric_average",
                                 **_process_set_kwargs(self.process_set)).numpy()
        for key, value in zip(keys, averaged):
            logs[key] = float(value)
