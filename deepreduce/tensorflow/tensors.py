"""The step engine's tensor port for eager TensorFlow tensors (what the summable route's ops read
and write; see :mod:`deepreduce.tensorflow.summable`). An eager tensor cannot be written in place,
so what a route writes (a flagged send the all-reduce's result replaces, an item's result) is a
:class:`Box` holding one."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf


class Box:
    """A mutable slot holding one eager tensor: what the engine's routes write "in place"."""

    __slots__ = ("value",)

    def __init__(self, value=None) -> None:
        self.value = value


class TFTensors:
    """The step engine's tensor port (:class:`deepreduce.collective.ports.Tensors`) for eager
    TensorFlow tensors; a written tensor (a flagged send, an item's target) is a :class:`Box`.
    Stateless."""

    @staticmethod
    def host(tensor) -> np.ndarray:
        return np.asarray(tensor, dtype=np.float32).reshape(-1)

    @staticmethod
    def write(target: Box, flat) -> None:
        target.value = tf.convert_to_tensor(flat)

    copy = write

    @staticmethod
    def divide(target: Box, ranks: int) -> None:
        target.value = target.value / tf.cast(ranks, target.value.dtype)

    @staticmethod
    def with_flag(tensor, dtype: str, flag: float) -> Box:
        parts = [tf.convert_to_tensor(t) for t in (tensor if isinstance(tensor, (list, tuple)) else [tensor])]
        kind = parts[0].dtype if dtype == "same" else tf.as_dtype(dtype)
        data = tf.concat([tf.reshape(tf.cast(p, kind), [-1]) for p in parts], 0)
        if flag:
            data = tf.zeros_like(data)
        return Box(tf.concat([data, tf.constant([flag], kind)], 0))

    @staticmethod
    def split_flag(summed: Box):
        return summed.value[:-1], float(summed.value[-1])

    @staticmethod
    def like(flat, shaped):
        return tf.reshape(flat, tf.shape(shaped))

    @staticmethod
    def all_finite(tensor) -> bool:
        tensor = tf.convert_to_tensor(tensor)
        return not tensor.dtype.is_floating or bool(tf.reduce_all(tf.math.is_finite(tensor)))

    @staticmethod
    def is_sparse(tensor) -> bool:
        return False

    @staticmethod
    def numel(tensor) -> int:
        return int(tf.size(tensor))

    @staticmethod
    def shape(tensor) -> Sequence[int]:
        return tuple(tensor.shape)
