"""Per-tensor cost of the TensorFlow binding's encode and decode ops, against the core.

For each config, on ResNet-20-sized gradients (64x64x3x3 = 36,864 float32), it times:
the NumPy core called directly; the TF pipeline inside ``tf.function`` with
``backend="numpy_function"`` (one ``tf.numpy_function`` op per tensor and direction); and, for
configs the custom ops serve, ``backend="tf-ops"`` (one ``DeepReduceEncode`` /
``DeepReduceDecode`` op per tensor). One ``tf.function`` call handles ``--tensors`` gradients,
so the fixed price of calling a ``tf.function`` is shared as in a training step; the figures are
median microseconds per tensor. Decode reads two containers per tensor (``decode_sum`` of a
2-rank allgather). The three paths run in turn in every round, and the ``ops/np_fn`` columns are
the medians of the per-round ratios of the two TF paths, so load on a shared machine hits both.

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

DEFAULT_CONFIGS = ["topk_raw", "bf_naive", "bf_p0", "bf_p1",
                   "bf_p2", "polyfit"]
SHAPE = (64, 64, 3, 3)


def interleaved_us(fns, repeat: int, per: int):
    """Median us per item of each function, and the median of the per-round ratios fns[2] / fns[1].

    Every round runs each function once, in turn, so a load change on a shared machine hits all
    of them alike; the paired ratio is the figure to compare across machines."""
    for fn in fns:
        fn()
        fn()
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    medians = [1e6 * statistics.median(t) / per for t in times]
    ratio = statistics.median(b / a for a, b in zip(times[1], times[2])) if len(fns) == 3 else float("nan")
    return medians + [float("nan")] * (3 - len(fns)), ratio


def bench_config(path: str, grads, repeat: int) -> list:
    """Encode and decode: ([core, numpy_function, ops] us per tensor, ops/numpy_function paired
    ratio) each; nan where the ops do not serve the config."""
    count = len(grads)
    names = [f"w{i}" for i in range(count)]
    core, peer = deepreduce.build(path), deepreduce.build(path)
    payloads = [np.concatenate([core.encode(g, name=n, step=0), peer.encode(g[::-1].copy(), name=n, step=0)])
                for g, n in zip(grads, names)]
    xs = [tf.constant(g) for g in grads]
    bufs = [tf.constant(p) for p in payloads]
    step = tf.Variable(0, dtype=tf.int64)
    encoders = [lambda: [core.encode(g, name=n, step=0) for g, n in zip(grads, names)]]
    decoders = [lambda: [core.decode_sum(deepreduce.wire.container.split(p), SHAPE) for p in payloads]]
    backends = ["numpy_function"] + (["tf-ops"] if ops.unsupported(core) is None else [])
    for backend in backends:
        pipe = drtf.build(path, backend=backend)
        encode = tf.function(lambda *t, pipe=pipe: [pipe.encode(x, name=n, step=step) for x, n in zip(t, names)])
        decode = tf.function(lambda *b, pipe=pipe: [pipe.decode_sum(p, SHAPE, count=2) for p in b])
        encoders.append(lambda encode=encode: encode(*xs))
        decoders.append(lambda decode=decode: decode(*bufs))
    return [interleaved_us(encoders, repeat, count), interleaved_us(decoders, repeat, count)]


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
        (enc, enc_ratio), (dec, dec_ratio) = bench_config(path, grads, args.repeat)
        print(f"{os.path.basename(path):20s} {enc[0]:9.0f} {enc[1]:7.0f} {enc[2]:7.0f} {enc_ratio:9.2f}   "
              f"{dec[0]:9.0f} {dec[1]:7.0f} {dec[2]:7.0f} {dec_ratio:9.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
