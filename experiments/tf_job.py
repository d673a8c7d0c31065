"""What the TensorFlow training jobs share: their options, their start (Horovod, seed, data,
model), ResNet-20 in Keras, the digits in NHWC, the learning-rate schedule and the per-epoch
record (printed with the PyTorch job's line) and metrics file.

``examples/train_tf.py`` (custom loop with ``DistributedGradientTape``) and
``examples/train_keras.py`` (``model.fit`` with the Keras callbacks) both build on it, so the
three jobs report the same quantities in the same format (:data:`experiments.train.EPOCH_LINE`).
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import numpy as np

from .train import EPOCH_LINE, add_common_arguments

__all__ = ["EPOCH_LINE", "Job", "add_job_arguments", "run_job", "start", "save_metrics", "resnet20", "digits_nhwc",
           "cosine_lr", "epoch_record", "epoch_line"]


def add_job_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options both TF jobs take: the PyTorch job's common ones plus ``--tf-backend``."""
    add_common_arguments(parser, "no compression: Horovod allreduce", "TensorFlow intra-op threads per rank")
    parser.add_argument("--tf-backend", default="auto", choices=("auto", "tf-ops", "numpy_function"),
                        help="encode/decode as the TF custom ops (auto: when built and the config qualifies) "
                             "or as numpy_function stages")
    return parser


def run_job(train: Callable[[argparse.Namespace], Any], doc: str, argv: Optional[List[str]] = None) -> int:
    """A TF job's ``main``: parse its options (described by the first line of ``doc``) and train."""
    train(add_job_arguments(argparse.ArgumentParser(description=doc.split("\n")[0])).parse_args(argv))
    return 0


class Job(NamedTuple):
    """What :func:`start` set up: the modules, the rank's data, the model and the scaled lr."""

    tf: Any
    hvd: Any
    keras: Any
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    model: Any
    base_lr: float


def start(args: argparse.Namespace) -> Job:
    """The start both TF jobs share: TF threads, ``hvd.init()``, the seed, the digits, ResNet-20
    and the learning rate scaled by the number of ranks."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(max(1, args.threads))
    import horovod.tensorflow as hvd
    import keras

    hvd.init()
    keras.utils.set_random_seed(args.seed)
    x_train, y_train, x_test, y_test = digits_nhwc()
    return Job(tf, hvd, keras, x_train, y_train, x_test, y_test, resnet20(keras), args.lr * hvd.size())


def save_metrics(args: argparse.Namespace, job: Job, framework: str, history: List[dict]) -> None:
    """Rank 0 writes the per-epoch records to ``--metrics-json`` (when given)."""
    if job.hvd.rank() == 0 and args.metrics_json:
        with open(args.metrics_json, "w", encoding="utf-8") as handle:
            json.dump({"framework": framework, "config": None if args.baseline else args.config,
                       "ranks": job.hvd.size(), "epochs": history}, handle, indent=2)


def resnet20(keras, num_classes: int = 10):
    """ResNet-20 (CIFAR variant, option-A shortcuts): 269,722 trainable parameters, NHWC input."""
    layers = keras.layers

    class PadShortcut(layers.Layer):
        """Stride-2 subsampling with zero channels appended (option A, no parameters)."""

        def __init__(self, pad: int, **kwargs):
            super().__init__(**kwargs)
            self.pad = pad

        def call(self, x):
            import tensorflow as tf

            x = x[:, ::2, ::2, :]
            return tf.pad(x, [[0, 0], [0, 0], [0, 0], [self.pad // 2, self.pad - self.pad // 2]])

    def conv(planes, stride=1):
        return layers.Conv2D(planes, 3, strides=stride, padding="same", use_bias=False,
                             kernel_initializer=keras.initializers.VarianceScaling(2.0, "fan_out", "untruncated_normal"))

    def bn():
        return layers.BatchNormalization(momentum=0.9, epsilon=1e-5)

    inputs = keras.Input((32, 32, 3))
    x = layers.ReLU()(bn()(conv(16)(inputs)))
    in_planes = 16
    for planes, stride in ((16, 1), (32, 2), (64, 2)):
        for block in range(3):
            s = stride if block == 0 else 1
            out = layers.ReLU()(bn()(conv(planes, s)(x)))
            out = bn()(conv(planes)(out))
            shortcut = x if (s == 1 and planes == in_planes) else PadShortcut(planes - in_planes)(x)
            x = layers.ReLU()(layers.Add()([out, shortcut]))
            in_planes = planes
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(num_classes)(x)
    return keras.Model(inputs, outputs, name="resnet20")


def digits_nhwc() -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The PyTorch job's digits split (:func:`experiments.digits.load_digits_32`) with NHWC images."""
    from .digits import load_digits_32

    x_train, y_train, x_test, y_test = load_digits_32()
    x_train, x_test = (np.ascontiguousarray(x.transpose(0, 2, 3, 1)) for x in (x_train, x_test))
    return x_train, y_train, x_test, y_test


def cosine_lr(base_lr: float, epoch: int, epochs: int) -> float:
    """The learning rate of epoch ``epoch`` (0-based): cosine from ``base_lr`` over ``epochs``."""
    return base_lr * 0.5 * (1 + math.cos(math.pi * epoch / max(1, epochs)))


def epoch_record(epoch: int, loss: float, acc: float, volume: float, seconds: float) -> dict:
    """One epoch's metrics (``epoch`` 1-based), as the jobs write them to ``--metrics-json``."""
    return {"epoch": epoch, "loss": float(loss), "acc": float(acc), "volume": float(volume), "seconds": float(seconds)}


def epoch_line(record: dict) -> str:
    """The PyTorch job's per-epoch line for a record of :func:`epoch_record`."""
    return EPOCH_LINE.format(acc_pct=100 * record["acc"], **record)
