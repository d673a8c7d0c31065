"""Worker: the TensorFlow tape's aggregations on N ranks (``mpirun -np N``).

``python tf_aggregations.py <case>`` prints ``OK <case> <mode> <rank>`` per checked mode:

- ``exact``: Top-r 10% with raw codecs and no residual, eager and compiled: the sparse
  all-reduce without re-selection (``reselect: none``) returns the allgather's sum bit for bit
  (each rank selects the same entries in both runs: same gradients, same seeds), and the ranks
  agree;
- ``auto``: ``aggregation: auto`` at a fixed fast link (eager) and slow link (compiled): the plan is made after the first step, the same
  on every rank, printed once by rank 0, reported by ``compression_stats()``, followed by the
  tensors from then on (eager and compiled), and the ranks stay identical while training.
"""
import os
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import watchdog  # noqa: E402

import deepreduce.tensorflow as drtf  # noqa: E402

TOPK = {"sparsifier": {"id": "topk", "ratio": 0.1}, "index": "raw", "value": "raw", "memory": "none",
        "min_numel": 0}
SHAPES = [(64, 50), (50,), (50, 8)]
STEPS = 3


def gradients_of(config, mode: str):
    """Every step's reduced gradients of a small model, each rank with its own data."""
    rng = np.random.default_rng(0)
    variables = [tf.Variable(rng.standard_normal(s).astype(np.float32)) for s in SHAPES]
    pipe = drtf.build(config)

    def step(x):
        with tf.GradientTape() as tape:
            hidden = tf.tanh(tf.matmul(x, variables[0]) + variables[1])
            loss = tf.reduce_sum(tf.square(tf.matmul(hidden, variables[2])))
        grads = drtf.DistributedGradientTape(tape, compression=pipe).gradient(loss, variables)
        for v, g in zip(variables, grads):
            v.assign_sub(0.01 * g)
        return grads

    run = tf.function(step) if mode == "function" else step
    out = []
    for k in range(STEPS):
        x = tf.constant(np.random.default_rng(100 * k + hvd.rank()).standard_normal((16, 64)).astype(np.float32))
        out.append([g.numpy() for g in run(x)])
    return out, pipe, variables


def same_on_every_rank(arrays) -> bool:
    flat = np.concatenate([a.ravel() for a in arrays])
    everyone = hvd.allgather(tf.constant(flat[None, :])).numpy()
    return all(np.array_equal(everyone[0], row) for row in everyone)


def exact(mode: str) -> None:
    allgather, _, _ = gradients_of(TOPK, mode)
    sparse, _, _ = gradients_of(dict(TOPK, aggregation={"id": "sparse_allreduce", "reselect": "none"}), mode)
    for step, (a, b) in enumerate(zip(allgather, sparse)):
        for x, y in zip(a, b):
            assert np.array_equal(x, y), (mode, step, float(np.abs(x - y).max()))
    assert same_on_every_rank(sparse[-1])


def auto(mode: str) -> None:
    # a fast link (all-reduce pays) eagerly, a slow one (compression pays) compiled: both kinds of route
    bandwidth = 10.0 if mode == "eager" else 0.001
    config = dict(TOPK, memory="residual", aggregation={"id": "auto", "bandwidth_gbit": bandwidth, "replan_every": 0})
    grads, pipe, variables = gradients_of(config, mode)
    stats = drtf.DistributedGradientTape(tf.GradientTape(), compression=pipe).compression_stats()
    assert stats["plans_made"] == 1, stats
    assert sorted(stats["plan"]) == ["grad_0", "grad_1", "grad_2"], stats
    everyone = hvd.allgather_object(sorted(stats["plan"].items()))
    assert all(p == everyone[0] for p in everyone), everyone
    # the first step by allgather (no plan yet), every later one by the plan's choice
    followed = {name: {choice: STEPS - 1} for name, choice in stats["plan"].items()}
    for counts in followed.values():
        counts["allgather"] = counts.get("allgather", 0) + 1
    assert stats["auto_routes"] == followed, stats
    assert same_on_every_rank([v.numpy() for v in variables])
    assert all(np.all(np.isfinite(g)) for step in grads for g in step)


def main() -> None:
    watchdog.arm(250)
    hvd.init()
    case = sys.argv[1]
    for mode in ("eager", "function"):
        {"exact": exact, "auto": auto}[case](mode)
        print(f"OK {case} {mode} {hvd.rank()}", flush=True)
    watchdog.disarm()


if __name__ == "__main__":
    main()
