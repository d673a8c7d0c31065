"""Cost of the TensorFlow binding's graph ops, per encode/decode of one gradient.

For each config it times, on one ResNet-20-sized gradient (64x64x3x3 = 36,864 float32):
the NumPy core called directly, the TF pipeline inside ``tf.function`` through
``tf.numpy_function`` (``backend="numpy_function"``), and, for
configs whose Bloom/polyfit work has custom ops, the custom-op path; the same for decode.
Prints median microseconds.

    python examples/bench_tf_pipeline.py [--repeat 50] [configs/...yaml ...]
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

DEFAULT_CONFIGS = ["configs/none_raw.yaml", "configs/topk_raw.yaml", "configs/bf_p0.yaml", "configs/bf_p2.yaml",
                   "configs/polyfit.yaml", "configs/bfp2_polyfit.yaml"]


def median_us(fn, repeat):
    fn()
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("configs", nargs="*", default=DEFAULT_CONFIGS)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args(argv)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    g = (np.random.default_rng(0).standard_normal((64, 64, 3, 3)) * 0.01).astype(np.float32)
    x = tf.constant(g)
    step = tf.Variable(0, dtype=tf.int64)
    print(f"{'config':22s} {'core encode':>12s} {'tf numpy_fn':>12s} {'tf ops':>10s} "
          f"{'core decode':>12s} {'tf numpy_fn':>12s} {'tf ops':>10s}   (median us, d = {g.size})")
    for path in args.configs:
        core = deepreduce.build(path)
        via_numpy = drtf.build(path, backend="numpy_function")
        via_ops = drtf.build(path)
        payload = core.encode(g, name="w", step=0)
        enc_np = tf.function(lambda t: via_numpy.encode(t, name="w", step=step))
        enc_ops = tf.function(lambda t: via_ops.encode(t, name="w", step=step))
        dec = tf.function(lambda b: via_numpy.decode(b, g.shape))
        dec_ops = tf.function(lambda b: via_ops.decode(b, g.shape))
        p = tf.constant(payload)
        row = [
            median_us(lambda: core.encode(g, name="w", step=0), args.repeat),
            median_us(lambda: enc_np(x).numpy(), args.repeat),
            median_us(lambda: enc_ops(x).numpy(), args.repeat) if via_ops.backend == "tf-ops" else float("nan"),
            median_us(lambda: core.decode(payload, g.shape), args.repeat),
            median_us(lambda: dec(p).numpy(), args.repeat),
            median_us(lambda: dec_ops(p).numpy(), args.repeat) if via_ops.backend == "tf-ops" else float("nan"),
        ]
        name = os.path.basename(path)
        print(f"{name:22s} {row[0]:12.0f} {row[1]:12.0f} {row[2]:10.0f} {row[3]:12.0f} {row[4]:12.0f} {row[5]:10.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
