"""The main job in TensorFlow: data-parallel ResNet-20 on the digits images, gradients as DeepReduce containers.

Run with N ranks under Horovod, e.g.::

    horovodrun -np 2 -H localhost:2 python examples/train_tf.py --config configs/topk_raw.yaml
    horovodrun -np 2 -H localhost:2 python examples/train_tf.py --baseline     # hvd.allreduce, no compression

A custom training loop (``tf.function`` train step) with ``deepreduce.tensorflow.DistributedGradientTape``;
Horovod's Keras callbacks and Keras optimizer wrapper do not work with Keras 3. Each epoch rank 0
prints the same line as the PyTorch job (deepreduce/train.py): training loss averaged over ranks,
test accuracy, relative data volume (bytes put on the wire over dense float32 bytes, averaged
over ranks) and wall time.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

EPOCH_LINE = "epoch {epoch:3d} | train loss {loss:.4f} | test acc {acc_pct:.2f}% | rel volume {volume:.4f} | time {seconds:.1f}s"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/topk_raw.yaml", help="DeepReduce config (YAML)")
    parser.add_argument("--baseline", action="store_true", help="no compression: Horovod allreduce")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (scaled by the number of ranks)")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow intra-op threads per rank")
    parser.add_argument("--max-steps", type=int, default=0, help="stop each epoch after this many steps (0: all)")
    parser.add_argument("--tf-backend", default="auto", choices=("auto", "tf-ops", "numpy_function"),
                        help="Bloom/polyfit through the TF custom ops (auto: when built) or numpy_function")
    parser.add_argument("--metrics-json", default=None, help="rank 0 writes per-epoch metrics here")
    return parser.parse_args(argv)


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


def train(args: argparse.Namespace) -> List[dict]:
    """Run the job on the current Horovod world; returns rank 0's per-epoch metrics."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(max(1, args.threads))
    import horovod.tensorflow as hvd
    import keras

    import deepreduce.tensorflow as drtf
    from deepreduce.data import load_digits_32, shard

    hvd.init()
    keras.utils.set_random_seed(args.seed)
    x_train, y_train, x_test, y_test = load_digits_32()
    x_train, x_test = (np.ascontiguousarray(x.transpose(0, 2, 3, 1)) for x in (x_train, x_test))   # NCHW -> NHWC
    model = resnet20(keras)
    for i, v in enumerate(model.variables):   # start every rank from rank 0's weights
        v.assign(hvd.broadcast(tf.convert_to_tensor(v), root_rank=0, name=f"init_{i}"))
    base_lr = args.lr * hvd.size()
    # weight decay inside the optimizer, after the reduction (as torch's SGD): it is not communicated
    optimizer = keras.optimizers.SGD(learning_rate=base_lr, momentum=args.momentum, weight_decay=args.weight_decay)
    pipe = None if args.baseline else drtf.build(args.config, backend=args.tf_backend)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        tape = drtf.DistributedGradientTape(tape, compression=pipe, step=optimizer.iterations)
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    @tf.function
    def predict(x):
        return tf.argmax(model(x, training=False), axis=1)

    history = []
    dense_bytes_per_step = 4 * sum(int(np.prod(v.shape)) for v in variables)
    for epoch in range(args.epochs):
        start = time.perf_counter()
        optimizer.learning_rate.assign(base_lr * 0.5 * (1 + math.cos(math.pi * epoch / max(1, args.epochs))))
        before = 0 if pipe is None else pipe.stats.wire_bytes
        indices = shard(len(y_train), hvd.rank(), hvd.size(), epoch, seed=args.seed)
        steps = len(indices) // args.batch_size
        if args.max_steps:
            steps = min(steps, args.max_steps)
        losses = []
        for step in range(steps):
            batch = indices[step * args.batch_size:(step + 1) * args.batch_size]
            losses.append(float(train_step(tf.constant(x_train[batch]), tf.constant(y_train[batch]))))
        volume = 1.0 if pipe is None else (pipe.stats.wire_bytes - before) / max(1, dense_bytes_per_step * steps)
        mean_loss = float(hvd.allreduce(tf.constant(float(np.mean(losses))), name="epoch_loss"))
        mean_volume = float(hvd.allreduce(tf.constant(volume), name="epoch_volume"))
        predictions = np.concatenate([predict(tf.constant(x_test[i:i + 256])).numpy()
                                      for i in range(0, len(x_test), 256)])
        record = {"epoch": epoch + 1, "loss": mean_loss, "acc": float((predictions == y_test).mean()),
                  "volume": mean_volume, "seconds": time.perf_counter() - start}
        history.append(record)
        if hvd.rank() == 0:
            print(EPOCH_LINE.format(acc_pct=100 * record["acc"], **record), flush=True)
    if hvd.rank() == 0 and args.metrics_json:
        with open(args.metrics_json, "w", encoding="utf-8") as handle:
            json.dump({"framework": "tensorflow", "config": None if args.baseline else args.config,
                       "ranks": hvd.size(), "epochs": history}, handle, indent=2)
    return history


def main(argv: Optional[List[str]] = None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
