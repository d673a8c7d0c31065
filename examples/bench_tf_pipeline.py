"""Per-tensor cost of the TensorFlow binding's encode and decode ops, against the core.

For each config, on ResNet-20-sized gradients (64x64x3x3 = 36,864 float32), it times:
the NumPy core called directly; the TF pipeline inside ``tf.function`` with
``backend="numpy_function"`` (one ``tf.numpy_function`` op per tensor and direction); and, for
configs the custom ops serve, ``backend="tf-ops"`` (one ``DeepReduceEncode`` /
``DeepReduceDecode`` op per tensor). One ``tf.function`` call handles ``--tensors`` gradients,
so the fixed price of calling a ``tf.function`` is shared as in a training step; the figures are
median microseconds per tensor. Decode reads two containers per tensor (``decode_sum`` of a
2-rank allgather). The ``ops/np_fn`` columns are the ratios of the two TF paths in this run.

    python examples/bench_tf_pipeline.py [--repeat 100] [--tensors 16] [configs/...yaml ...]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import deepreduce  # noqa: E402
import deepreduce.tensorflow as drtf  # noqa: E402
from deepreduce.tensorflow import ops  # noqa: E402

DEFAULT_CONFIGS = ["configs/topk_raw.yaml", "configs/bf_naive.yaml", "configs/bf_p0.yaml", "configs/bf_p1.yaml",
                   "configs/bf_p2.yaml", "configs/polyfit.yaml"]
SHAPE = (64, 64, 3, 3)


def median_us(fn, repeat: int, per: int) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs (after two warm-ups), in us per item."""
    fn()
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times) / per


def bench_config(path: str, grads, repeat: int) -> list:
    """[core enc, np_fn enc, ops enc, core dec, np_fn dec, ops dec] in us per tensor (nan: no ops)."""
    count = len(grads)
    names = [f"w{i}" for i in range(count)]
    core, peer = deepreduce.build(path), deepreduce.build(path)
    payloads = [np.concatenate([core.encode(g, name=n, step=0), peer.encode(g[::-1].copy(), name=n, step=0)])
                for g, n in zip(grads, names)]
    xs = [tf.constant(g) for g in grads]
    bufs = [tf.constant(p) for p in payloads]
    step = tf.Variable(0, dtype=tf.int64)
    row = [median_us(lambda: [core.encode(g, name=n, step=0) for g, n in zip(grads, names)], repeat, count)]
    dec_row = [median_us(lambda: [core.decode_sum(deepreduce.container.split(p), SHAPE) for p in payloads],
                         repeat, count)]
    for backend in ("numpy_function", "tf-ops"):
        if backend == "tf-ops" and ops.unsupported(core) is not None:
            row.append(float("nan"))
            dec_row.append(float("nan"))
            continue
        pipe = drtf.build(path, backend=backend)
        encode = tf.function(lambda *t: [pipe.encode(x, name=n, step=step) for x, n in zip(t, names)])
        decode = tf.function(lambda *b: [pipe.decode_sum(p, SHAPE, count=2) for p in b])
        row.append(median_us(lambda: encode(*xs), repeat, count))
        dec_row.append(median_us(lambda: decode(*bufs), repeat, count))
    return row + dec_row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("configs", nargs="*", default=DEFAULT_CONFIGS)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--tensors", type=int, default=16, help="gradients per tf.function call")
    args = parser.parse_args(argv)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rng = np.random.default_rng(0)
    grads = [(rng.standard_normal(SHAPE) * 0.01).astype(np.float32) for _ in range(args.tensors)]
    print(f"median us per tensor, d = {int(np.prod(SHAPE))}, {args.tensors} tensors per tf.function call, "
          f"{args.repeat} repeats")
    print(f"{'config':20s} {'enc core':>9s} {'np_fn':>7s} {'ops':>7s} {'ops/np_fn':>9s}   "
          f"{'dec core':>9s} {'np_fn':>7s} {'ops':>7s} {'ops/np_fn':>9s}")
    for path in args.configs:
        r = bench_config(path, grads, args.repeat)
        print(f"{os.path.basename(path):20s} {r[0]:9.0f} {r[1]:7.0f} {r[2]:7.0f} {r[2] / r[1]:9.2f}   "
              f"{r[3]:9.0f} {r[4]:7.0f} {r[5]:7.0f} {r[5] / r[4]:9.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
