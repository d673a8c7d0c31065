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

And for a summable compressor (``summable_fp16``: Horovod's ``Compression.fp16`` inside a wrapper,
which puts it on the engine's summable route, as any compressor but Horovod's own casts;
``summable_gradiveq``: GradiVeQ, compressing from step 2), which has no ``nonfinite`` option: the
NaN reaches every rank's weights (and ``compression_stats()["nonfinite_propagated"]``), and
rank 1's ``compress`` raising at step 2 makes every rank raise with no weight moved. Before that,
a few steps give weights bit-identical to Horovod's own ``hvd.DistributedGradientTape`` with the
same compressor.

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
from policy_checks import aggregation, route_id  # noqa: E402

import deepreduce.tensorflow as drtf  # noqa: E402

GRAPH_ROUTES = ("allgather", "entries")
SUMMABLE = ("summable_fp16", "summable_gradiveq")
BASE = {"sparsifier": {"id": "topk", "ratio": 0.5}, "index": "raw", "value": "raw", "memory": "residual",
        "min_numel": 0}


class Faulty:
    """A summable compressor whose ``compress`` raises while ``failing`` (on the rank that sets it)."""

    def __init__(self, inner) -> None:
        self.inner, self.failing = inner, False
        self.accepts_name = getattr(inner, "accepts_name", False)

    def compress(self, tensor, **kwargs):
        if self.failing:
            raise RuntimeError("injected compress failure")
        return self.inner.compress(tensor, **kwargs)

    def decompress(self, tensor, ctx):
        return self.inner.decompress(tensor, ctx)


def summable(route: str, warmup: int = 1):
    """The compressor of a summable route; GradiVeQ samples 2 steps after ``warmup``, then compresses."""
    if route == "summable_fp16":
        return hvd.Compression.fp16
    return drtf.GradiVeQ(warmup=warmup, sample_iters=2, compress_iters=4, slice_size=8, min_numel=64)


def run(route: str, policy: str, mode: str):
    config = dict(BASE, nonfinite=policy)
    graph = route in GRAPH_ROUTES
    if route in SUMMABLE:
        pipe = Faulty(summable(route, warmup=2))   # the NaN step is a warm-up step: no model learns from it
    else:
        if not graph:
            config.update(aggregation(route) or {"aggregation": {"id": "sparse_allreduce"}})
        pipe = drtf.build(config)
    rng = np.random.default_rng(0)
    variables = [tf.Variable(rng.standard_normal((8, 40)).astype(np.float32)),
                 tf.Variable(rng.standard_normal((40, 2)).astype(np.float32) * 0.1)]
    optimizer = keras.optimizers.SGD(0.01)
    stats = {}

    def forward(x):
        if route == "entries":   # rows 0-3 of the first weight: its gradient is an IndexedSlices
            return tf.matmul(tf.tanh(tf.matmul(x, tf.gather(variables[0], [0, 1, 2, 3, 1]))), variables[1])
        return tf.matmul(tf.tanh(tf.matmul(x, variables[0])), variables[1])

    def step(x, scale):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(forward(x))) * scale
        distributed = drtf.DistributedGradientTape(tape, compression=pipe)
        grads = distributed.gradient(loss, variables)
        stats["tape"] = distributed
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
    if route in SUMMABLE:
        summable_policies(route, take, weights, variables, stats)
        return
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
        real = engine.routes[route_id(route)].start

        def start(eng, item):
            if hvd.rank() == 1:
                raise RuntimeError("injected start failure")
            return real(eng, item)
        engine.routes[route_id(route)].start = start
        before, kept = weights(), residuals(pipe, engine)
        raised = take(2)
        engine.routes[route_id(route)].start = real
        assert raised is not None, (route, mode)
        assert np.array_equal(weights(), before), (route, mode)
        after = residuals(pipe, engine)   # under either policy nothing a rank compressed away is lost
        assert kept.keys() == after.keys() and all(np.array_equal(kept[k], after[k]) for k in kept), (route, policy)
    assert take(3) is None and np.isfinite(weights()).all()
    everyone = hvd.allgather(tf.constant(weights()[None, :])).numpy()
    assert np.array_equal(everyone[0], everyone[1]), (route, policy, mode)


def residuals(pipe, engine) -> dict:
    """Copies of every dense error-feedback residual: the rank's own and the sparse all-reduce's owner ones."""
    held = {k: np.array(v, copy=True) for k, v in pipe.core.memory.state_dict().get("residuals", {}).items()
            if not isinstance(v, dict)}
    sparse = engine.protocol.sparse
    if sparse is not None:
        held.update({f"owner.{k}": np.array(v, copy=True) for k, v in sparse.state_dict()["owner_residuals"].items()})
    return held


def summable_policies(route: str, take, weights, variables, stats):
    """A NaN propagates (whatever the config's policy would say: a compressor has none); rank 1's
    compress raising makes every rank raise with the weights unchanged."""
    raised = take(1, float("nan") if hvd.rank() == 1 else 1.0)
    assert raised is None, (route, raised)
    assert np.isnan(weights()).any(), route
    assert stats["tape"].compression_stats()["nonfinite_propagated"] >= 1, route
    for v in variables:
        v.assign(np.random.default_rng(1).standard_normal(v.shape).astype(np.float32))
    compressor = stats["tape"]._deepreduce.hvd_compression
    # GradiVeQ: 2 sampling steps and a compressed one; the failing step is the second compressed one (a
    # failed rank sends zeros shaped like its last codes, so not the step where the codes first shrink)
    assert take(4) is None and take(5) is None and take(6) is None
    compressor.failing = hvd.rank() == 1
    before = weights()
    raised = take(2)
    compressor.failing = False
    assert raised is not None, route
    if hvd.rank() == 1:
        assert "injected compress failure" in str(raised), raised
    else:
        assert "could not prepare its gradient" in str(raised), raised
    assert np.array_equal(weights(), before), route
    assert take(3) is None and np.isfinite(weights()).all()
    if route == "summable_gradiveq":
        assert compressor.inner.compression_stats()["compressed"] >= 2, compressor.inner.compression_stats()
    everyone = hvd.allgather(tf.constant(weights()[None, :])).numpy()
    assert np.array_equal(everyone[0], everyone[1]), route


def same_as_horovod(route: str, mode: str) -> None:
    """Five steps through deepreduce's tape and through Horovod's own with the same (fresh)
    compressor leave bit-identical weights (GradiVeQ: warm-up, sampling, then compressed steps)."""
    def train(tape_class):
        compressor = summable(route)
        rng = np.random.default_rng(0)
        variables = [tf.Variable(rng.standard_normal((8, 40)).astype(np.float32)),
                     tf.Variable(rng.standard_normal((40, 2)).astype(np.float32) * 0.1)]
        optimizer = keras.optimizers.SGD(0.01)

        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(tf.matmul(tf.tanh(tf.matmul(x, variables[0])), variables[1])))
            grads = tape_class(tape, compression=compressor).gradient(loss, variables)
            optimizer.apply_gradients(zip(grads, variables))

        fn = tf.function(step) if mode == "function" or tape_class is hvd.DistributedGradientTape else step
        for i in range(5):
            fn(tf.constant(np.random.default_rng(i * 10 + hvd.rank()).standard_normal((4, 8)).astype(np.float32)))
        if route == "summable_gradiveq":
            assert compressor.compression_stats()["compressed"] >= 2, compressor.compression_stats()
        return np.concatenate([v.numpy().ravel() for v in variables])

    ours, theirs = train(drtf.DistributedGradientTape), train(hvd.DistributedGradientTape)
    assert np.array_equal(ours, theirs), (route, mode, np.abs(ours - theirs).max())


def main():
    hvd.init()
    watchdog.arm(540)
    for route in SUMMABLE:
        for mode in ("eager", "function"):
            same_as_horovod(route, mode)
            run(route, "propagate", mode)
            print(f"OK tf {route} {mode} {hvd.rank()}", flush=True)
    for route in ("allgather", "entries", "sparse_allreduce", "sparse_allreduce_early", "dense", "fp16"):
        for policy in ("propagate", "raise"):
            for mode in ("eager", "function"):
                run(route, policy, mode)
                print(f"OK tf {route} {policy} {mode} {hvd.rank()}", flush=True)


main()
