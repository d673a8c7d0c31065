"""Worker: the ``nonfinite`` policy and a caught error over the TensorFlow tape's routes.

For the allgather (graph ops: a dense tensor's container, and ``entries``: an embedding's
``IndexedSlices`` gradient as its touched entries) and the step engine's host routes
(sparse_allreduce, dense, fp16), eagerly and inside ``tf.function``:

* ``nan``: rank 1's gradient is NaN at step 1. Under ``propagate`` no rank raises and every rank
  applies the NaN (an AMP loss scale would skip it); under ``raise`` every rank raises (eagerly a
  NonFiniteGradientError, in a ``tf.function`` TensorFlow's UnknownError carrying its text) and
  no weight moves.
* ``error`` (host routes): rank 1's route raises while starting a tensor at step 2: every rank
  raises, no weight moves.

Afterwards the next step works and the ranks hold the same weights.
"""
import os
import sys

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import watchdog  # noqa: E402

import deepreduce.tensorflow as drtf  # noqa: E402

GRAPH_ROUTES = ("allgather", "entries")
BASE = {"sparsifier": {"id": "topk", "ratio": 0.5}, "index": "raw", "value": "raw", "memory": "residual",
        "min_numel": 0}


def run(route: str, policy: str, mode: str):
    config = dict(BASE, nonfinite=policy)
    graph = route in GRAPH_ROUTES
    if not graph:
        config["aggregation"] = {"id": "sparse_allreduce"}
    pipe = drtf.build(config)
    rng = np.random.default_rng(0)
    variables = [tf.Variable(rng.standard_normal((8, 40)).astype(np.float32)),
                 tf.Variable(rng.standard_normal((40, 2)).astype(np.float32) * 0.1)]
    optimizer = keras.optimizers.SGD(0.01)

    def forward(x):
        if route == "entries":   # rows 0-3 of the first weight: its gradient is an IndexedSlices
            return tf.matmul(tf.tanh(tf.matmul(x, tf.gather(variables[0], [0, 1, 2, 3, 1]))), variables[1])
        return tf.matmul(tf.tanh(tf.matmul(x, variables[0])), variables[1])

    def step(x, scale):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(forward(x))) * scale
        grads = drtf.DistributedGradientTape(tape, compression=pipe).gradient(loss, variables)
        assert isinstance(grads[0], tf.IndexedSlices) == (route == "entries"), (route, type(grads[0]))
        optimizer.apply_gradients(zip(grads, variables))

    fn = tf.function(step) if mode == "function" else step
    weights = lambda: np.concatenate([v.numpy().ravel() for v in variables])   # noqa: E731

    def take(i, scale=1.0):
        width = 5 if route == "entries" else 8
        x = tf.constant(np.random.default_rng(i * 10 + hvd.rank()).standard_normal((4, width)).astype(np.float32))
        try:
            fn(x, tf.constant(scale, tf.float32))
            return None
        except Exception as exc:   # noqa: BLE001 (rank 1 raises its own error, the others a deepreduce one)
            return exc

    assert take(0) is None
    if route in ("dense", "fp16"):   # what the auto plan picks for a tensor that hides behind backward
        engine = next(iter(pipe.protocols.values()))
        engine.protocol.route = lambda name: route
    before = weights()
    raised = take(1, float("nan") if hvd.rank() == 1 else 1.0)
    if policy == "raise":
        assert raised is not None and "NaN" in str(raised), (route, mode, raised)
        assert np.array_equal(weights(), before), (route, mode)
    else:
        assert raised is None, (route, mode, raised)
        assert np.isnan(weights()).any(), (route, mode)
        for v in variables:   # start again from finite weights, the same on every rank
            v.assign(np.random.default_rng(1).standard_normal(v.shape).astype(np.float32))
    if not graph:
        engine = next(iter(pipe.protocols.values()))
        real = engine.routes[route].start

        def start(eng, item):
            if hvd.rank() == 1:
                raise RuntimeError("injected start failure")
            return real(eng, item)
        engine.routes[route].start = start
        before = weights()
        raised = take(2)
        engine.routes[route].start = real
        assert raised is not None, (route, mode)
        assert np.array_equal(weights(), before), (route, mode)
    assert take(3) is None and np.isfinite(weights()).all()
    everyone = hvd.allgather(tf.constant(weights()[None, :])).numpy()
    assert np.array_equal(everyone[0], everyone[1]), (route, policy, mode)


def main():
    hvd.init()
    watchdog.arm(240)
    for route in ("allgather", "entries", "sparse_allreduce", "dense", "fp16"):
        for policy in ("propagate", "raise"):
            for mode in ("eager", "function"):
                run(route, policy, mode)
                print(f"OK tf {route} {policy} {mode} {hvd.rank()}", flush=True)


main()
