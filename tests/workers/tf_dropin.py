"""Horovod's TensorFlow patterns with deepreduce's classes (one rank, under mpirun).

``python tf_dropin.py <folder>`` writes ``<folder>/rank<r>.json``:

- ``eager_then_graph``: one step function run eagerly, then built in a ``tf.compat.v1`` graph,
  wraps its tape in ``DistributedGradientTape`` with a config name (the shared pipeline); both
  must give the ranks' average gradient.
- ``local_variables``: ``BroadcastGlobalVariablesCallback(0, local_variables=[v])`` gives every
  variable rank 0's value but ``v``, which keeps this rank's.

A rank that hangs prints its stacks and exits (``watchdog.arm``).
"""
import json
import os
import sys

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import watchdog  # noqa: E402

import deepreduce.tensorflow as drtf  # noqa: E402
import deepreduce.tensorflow.keras as drk  # noqa: E402


def step(w, x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(tf.matmul(x, w)))
    return drtf.DistributedGradientTape(tape, compression="none_raw").gradient(loss, [w])[0]


def eager_then_graph() -> dict:
    x = np.full([4, 64], hvd.rank() + 1.0, np.float32)
    expected = np.mean([2 * (np.full([4, 64], r + 1.0, np.float32).T @ (np.full([4, 64], r + 1.0, np.float32)
                                                                            @ np.ones([64, 40], np.float32)))
                        for r in range(hvd.size())], axis=0)
    eager = step(tf.Variable(tf.ones([64, 40])), tf.constant(x)).numpy()
    with tf.Graph().as_default():
        w = tf.compat.v1.Variable(tf.ones([64, 40]))
        grad = step(w, tf.constant(x))
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            graph = session.run(grad)
    return {"eager_ok": bool(np.allclose(eager, expected, rtol=1e-6)),
            "graph_ok": bool(np.allclose(graph, expected, rtol=1e-6))}


def local_variables() -> dict:
    keras.utils.set_random_seed(hvd.rank())
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    local = model.layers[1].kernel
    before = local.numpy().copy()
    callback = drk.BroadcastGlobalVariablesCallback(0, local_variables=[local])
    callback.set_model(model)
    callback.on_train_begin()
    shared = model.layers[0].kernel.numpy()
    everyone = hvd.allgather_object(shared)
    return {"shared_equal": all(np.array_equal(everyone[0], s) for s in everyone),
            "local_kept": bool(np.array_equal(local.numpy(), before))}


def main() -> None:
    watchdog.arm(150)
    hvd.init()
    result = {"eager_then_graph": eager_then_graph(), "local_variables": local_variables(), "rank": hvd.rank()}
    with open(os.path.join(sys.argv[1], f"rank{hvd.rank()}.json"), "w") as f:
        json.dump(result, f)
    watchdog.disarm()


if __name__ == "__main__":
    main()
