"""Step time of the TensorFlow tape's reduction, eager one tensor after another vs on worker threads.

Run on 2 ranks::

    horovodrun -np 2 -H localhost:2 .venv/bin/python examples/bench_tf_eager.py [--rounds 15] [configs/...yaml ...]

The model has one variable per gradient of the shipped ResNet-20 set (experiments/data/gradients.npz,
59 tensors, 269,722 values) and the loss ``sum(v * g)``, so backward is trivial and each step's
gradients are the real ones; a step is ``DistributedGradientTape(...).gradient`` (backward,
encode, allgather, decode). Every round runs one step of each mode in turn: eager with
``background=False``, eager with 2, 4 (the default ``True``) and 8 worker threads, the same
step compiled with ``tf.function``, and compiled with each tensor's encode -> allgather ->
decode in program order (how the tape ordered them before; TensorFlow then runs one tensor
after another, see docs/tensorflow.md); rank 0 prints the median milliseconds per step of each mode,
the median over rounds of the per-round ratio to the sequential eager step (load on a shared
machine hits every mode of a round alike), and the share of the eager encode time that was hidden
behind other tensors' communication (``encode_hidden_seconds / eager_encode_seconds``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from experiments import runtime  # noqa: E402

runtime.apply_defaults()   # before hvd.init(), as the training jobs do

import horovod.tensorflow as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402

import deepreduce.tensorflow as drtf  # noqa: E402
from experiments import gradients  # noqa: E402

PER_TENSOR = "tf.function, per-tensor program order"
DEFAULT_CONFIGS = ["topk_raw", "bf_p0", "qsgd"]
MODES = [("eager, sequential", False), ("eager, 2 workers", 2), ("eager, 4 workers (default)", True),
         ("eager, 8 workers", 8), ("tf.function", False), (PER_TENSOR, False)]


def make_step(path: str, label: str, background, variables, targets):
    """One reduction step of its own pipeline; returns (step function, pipeline).

    ``PER_TENSOR`` compiles encode -> allgather -> decode_sum one tensor after another in program
    order (what the tape did before its encodes were put first): TensorFlow then chains each
    encode after the previous tensor's decode."""
    pipe = drtf.build(path)

    def step():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * t) for v, t in zip(variables, targets)])
        if label != PER_TENSOR:
            tape = drtf.DistributedGradientTape(tape, compression=pipe, background=background)
            return tape.gradient(loss, variables)
        out = []
        for i, g in enumerate(tape.gradient(loss, variables)):
            gathered = hvd.allgather(pipe.encode(g, name=f"grad_{i}", step=0), name=f"per_tensor_{i}")
            out.append(pipe.decode_sum(gathered, g.shape, count=hvd.size()) / hvd.size())
        return out

    return (step if label.startswith("eager") else tf.function(step)), pipe


def bench(path: str, rounds: int, variables, targets) -> list:
    """[(mode, median ms, median ratio to the sequential eager step, hidden share)] for one config."""
    steps = [make_step(path, label, background, variables, targets) for label, background in MODES]
    for step, _ in steps:   # warm up: agreement, tracing, kernel creation
        step()
        step()
    times = [[] for _ in steps]
    for _ in range(rounds):
        for (step, _), out in zip(steps, times):
            hvd.allreduce(tf.constant(0.0), name="bench_barrier")   # both ranks start the step together
            start = time.perf_counter()
            step()
            out.append(time.perf_counter() - start)
    rows = []
    for (label, _), (_, pipe), t in zip(MODES, steps, times):
        stats = pipe.compression_stats()
        share = stats["encode_hidden_seconds"] / stats["eager_encode_seconds"] if stats["eager_encode_seconds"] else 0.0
        ratio = statistics.median(b / a for a, b in zip(times[0], t))
        rows.append((label, 1e3 * statistics.median(t), ratio, share))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", default=DEFAULT_CONFIGS)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    hvd.init()
    grads = {k: v for k, v in gradients.load().items() if k != "all"}
    targets = [tf.constant(g * (1.0 + hvd.rank())) for g in grads.values()]   # the ranks' gradients differ
    variables = [tf.Variable(tf.zeros_like(t)) for t in targets]
    if hvd.rank() == 0:
        print(f"{len(targets)} gradients, {sum(int(tf.size(t)) for t in targets):,} values, {hvd.size()} ranks, "
              f"{args.rounds} rounds")
        print("| config | mode | ms per step (median) | / sequential eager (median of per-round ratios) "
              "| hidden share of eager encode |")
        print("|---|---|---|---|---|")
    for path in args.configs:
        for label, ms, ratio, share in bench(path, args.rounds, variables, targets):
            if hvd.rank() == 0:
                shown = f"{share:.2f}" if label.startswith("eager") else "-"
                print(f"| {os.path.basename(path)} | {label} | {ms:.1f} | {ratio:.2f} | {shown} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
