"""2-rank worker: DistributedGradientTape steps vs one process stepping on the averaged gradient.

Launched by tests/test_tensorflow_distributed.py under ``horovodrun -np 2``. Each rank holds
different data; with lossless raw codecs a few SGD steps through the tape (eager, inside
``tf.function`` with ``optimizer.iterations`` as the step, and through DistributedOptimizer)
must leave the weights bit-identical on both ranks and equal to a single process that steps on
the average of both ranks' gradients. A Top-r config must keep the ranks identical. Rank 0
writes the results as JSON to the path given as the first argument.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402

import deepreduce.tensorflow as drtf  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
LR = 0.1
STEPS = 3


def initial_weights():
    rng = np.random.default_rng(42)   # same on every rank
    return [rng.standard_normal((20, 64)).astype(np.float32) * 0.3, np.zeros(64, np.float32),
            rng.standard_normal((64, 3)).astype(np.float32) * 0.3, np.zeros(3, np.float32)]


def data(rank, step):
    rng = np.random.default_rng([rank, step])
    return rng.standard_normal((16, 20)).astype(np.float32), rng.integers(0, 3, 16)


def loss_fn(variables, x, y):
    w1, b1, w2, b2 = variables
    logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) + b2
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def local_grads(weights, x, y):
    variables = [tf.Variable(w) for w in weights]
    with tf.GradientTape() as tape:
        loss = loss_fn(variables, x, y)
    return [g.numpy() for g in tape.gradient(loss, variables)]


def reference(size, op="average"):
    """One process: SGD on the average (or sum) of every rank's gradient."""
    weights = initial_weights()
    for step in range(STEPS):
        per_rank = [local_grads(weights, *data(r, step)) for r in range(size)]
        for i in range(len(weights)):
            total = per_rank[0][i].copy()
            for r in range(1, size):
                total += per_rank[r][i]
            g = total * np.float32(1.0 / size) if op == "average" else total
            weights[i] = weights[i] - np.float32(LR) * g
    return weights


def run_tape(config, mode, op=None):
    pipe = drtf.build(config) if config is not None else None   # None: the hvd.allreduce baseline
    variables = [tf.Variable(w) for w in initial_weights()]
    opt = keras.optimizers.SGD(learning_rate=LR)

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(variables, x, y)
        tape = drtf.DistributedGradientTape(tape, compression=pipe, op=op, step=opt.iterations)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return loss

    fn = tf.function(step_fn) if mode == "function" else step_fn
    for step in range(STEPS):
        x, y = data(hvd.rank(), step)
        fn(tf.constant(x), tf.constant(y))
    return [v.numpy() for v in variables], pipe


def run_optimizer(config):
    pipe = drtf.build(config)
    variables = [tf.Variable(w) for w in initial_weights()]
    opt = drtf.DistributedOptimizer(keras.optimizers.SGD(learning_rate=LR), compression=pipe)

    @tf.function
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(variables, x, y)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    for step in range(STEPS):
        x, y = data(hvd.rank(), step)
        step_fn(tf.constant(x), tf.constant(y))
    return [v.numpy() for v in variables], pipe


def run_legacy_optimizer(config):
    """A tf.compat.v1 optimizer wrapped by DistributedOptimizer, stepped eagerly with minimize()."""
    variables = [tf.Variable(w) for w in initial_weights()]
    opt = drtf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR), compression=drtf.build(config))
    for step in range(STEPS):
        x, y = data(hvd.rank(), step)
        opt.minimize(lambda: loss_fn(variables, tf.constant(x), tf.constant(y)), var_list=variables)
    return [v.numpy() for v in variables]


def local_source_check(config):
    """One gradient() call with a registered local source: it is not averaged but scaled by 1/size."""
    weights = initial_weights()
    variables = [tf.Variable(w) for w in weights]
    x, y = data(hvd.rank(), 0)
    with tf.GradientTape() as tape:
        loss = loss_fn(variables, tf.constant(x), tf.constant(y))
    tape = drtf.DistributedGradientTape(tape, compression=drtf.build(config))
    tape.register_local_source(variables[3])
    grads = [g.numpy() for g in tape.gradient(loss, variables)]
    mine = local_grads(weights, x, y)
    every = [local_grads(weights, *data(r, 0)) for r in range(hvd.size())]
    averaged = [sum(e[i] for e in every) / hvd.size() for i in range(3)]
    return {"global_max_abs_diff": float(max(np.max(np.abs(grads[i] - averaged[i])) for i in range(3))),
            "local_max_abs_diff": float(np.max(np.abs(grads[3] - mine[3] / hvd.size())))}


def compare(weights, expected=None):
    """Bit-identity across ranks (allgather) and the largest deviation from ``expected``."""
    flat = np.concatenate([w.ravel() for w in weights])
    gathered = hvd.allgather(tf.constant(flat[None, :])).numpy()
    same = bool(all(np.array_equal(gathered[0], gathered[r]) for r in range(gathered.shape[0])))
    out = {"ranks_identical": same}
    if expected is not None:
        ref = np.concatenate([w.ravel() for w in expected])
        out["max_abs_diff"] = float(np.max(np.abs(flat - ref)))
    out["changed"] = float(np.max(np.abs(flat - np.concatenate([w.ravel() for w in initial_weights()]))))
    return out


def main():
    hvd.init()
    raw = os.path.join(ROOT, "configs", "none_raw.yaml")
    topk = os.path.join(ROOT, "configs", "topk_raw.yaml")
    ref_avg, ref_sum = reference(hvd.size()), reference(hvd.size(), "sum")
    results = {"size": hvd.size()}
    results["eager"] = compare(run_tape(raw, "eager")[0], ref_avg)
    weights, pipe = run_tape(raw, "function")
    results["function"] = compare(weights, ref_avg)
    results["function_wire_bytes"] = pipe.stats.wire_bytes
    results["function_tensors_encoded"] = pipe.stats.tensors_encoded
    results["sum"] = compare(run_tape(raw, "function", op=hvd.Sum)[0], ref_sum)
    results["optimizer"] = compare(run_optimizer(raw)[0], ref_avg)
    results["legacy_optimizer"] = compare(run_legacy_optimizer(raw), ref_avg)
    results["allreduce"] = compare(run_tape(None, "function")[0], ref_avg)
    results["local_source"] = local_source_check(raw)
    weights, pipe = run_tape(topk, "function")
    results["topk"] = compare(weights)
    results["topk_relative_volume"] = pipe.stats.relative_volume
    # Bloom P2 (custom ops when built): ranks stay identical
    weights, pipe = run_tape({"sparsifier": {"id": "topk", "ratio": 0.05}, "index": {"id": "bloom", "policy": "p2"},
                              "value": {"id": "raw"}, "memory": {"id": "residual"}}, "function")
    results["bloom"] = compare(weights)
    results["bloom_backend"] = pipe.backend
    if hvd.rank() == 0:
        with open(sys.argv[1], "w", encoding="utf-8") as handle:
            json.dump(results, handle)


if __name__ == "__main__":
    main()
