"""Worker: the TensorFlow binding's ``bucket_cap_mb`` on 2 ranks (writes rank 0's results as JSON).

* lossless: bucketed and per-gradient reductions are identical (eager and ``tf.function``);
* Top-r with residual memory, 2 steps: every gradient equals what the core pipeline (NumPy,
  another binding) gives for the bucket: the large gradients concatenated in reverse order,
  encoded under the bucket's name, all-gathered and decode-summed, then averaged and split; the
  small gradient goes on its own container;
* ranks whose caps plan different buckets fail together with the agreement's CommunicationError;
  a summable compressor with a cap is a ConfigError.
"""
import json
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import deepreduce
from deepreduce import CommunicationError, ConfigError
from deepreduce.collective.comm.horovod import HorovodCommunicator
from deepreduce.tensorflow import build
from deepreduce.tensorflow.reduce import Reducer

LOSSLESS = {"sparsifier": {"id": "none"}, "index": {"id": "raw"}, "value": {"id": "raw"}, "memory": {"id": "none"}}
TOPK = {"sparsifier": {"id": "topk", "ratio": 0.05}, "index": {"id": "raw"}, "value": {"id": "raw"},
        "memory": {"id": "residual"}}
SHAPES = [(64, 40), (40,), (30, 40)]      # 2,560 and 1,200 elements in one bucket; 40 on its own
NAMES = [f"grad_{i}" for i in range(len(SHAPES))]


def gradients(step):
    rng = np.random.default_rng([hvd.rank(), step])
    return [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]


def reduce(reducer, grads, step, compiled=False, names=NAMES):
    tensors = [tf.constant(g) for g in grads]
    if compiled:
        return [t.numpy() for t in tf.function(lambda *ts: reducer.reduce(list(ts), names, step))(*tensors)]
    return [t.numpy() for t in reducer.reduce(tensors, names, step)]


def lossless_equal():
    out = {}
    for compiled in (False, True):
        plain = reduce(Reducer(build(LOSSLESS), background=False), gradients(0), 0, compiled)
        bucketed = reduce(Reducer(build(LOSSLESS), bucket_cap_mb=1.0), gradients(0), 0, compiled)
        out["function" if compiled else "eager"] = all(np.array_equal(a, b) for a, b in zip(plain, bucketed))
    return out


def topk_matches_core():
    reducer = Reducer(build(TOPK), bucket_cap_mb=1.0)
    core = deepreduce.build(TOPK)
    comm = HorovodCommunicator(framework="tensorflow")
    max_diff = 0.0
    for step in range(2):
        grads = gradients(step)
        got = reduce(reducer, grads, step)
        flat = np.concatenate([grads[2].ravel(), grads[0].ravel()])      # reverse order: grad_2, grad_0
        parts = comm.allgather(core.encode(flat, name="bucket0.grad_2", step=step), f"check.{step}")
        total = core.decode_sum(parts, flat.shape) / hvd.size()
        small = core.decode_sum(comm.allgather(core.encode(grads[1], name="grad_1", step=step), f"small.{step}"),
                                grads[1].shape) / hvd.size()
        expected = [total[1200:].reshape(SHAPES[0]), small, total[:1200].reshape(SHAPES[2])]
        max_diff = max(max_diff, max(float(np.abs(a - b).max()) for a, b in zip(got, expected)))
    return max_diff


def error_of(fn):
    try:
        fn()
    except Exception as exc:  # the scenario reports what was raised
        return type(exc).__name__, str(exc)
    return None, ""


def main():
    hvd.init()
    result = {"lossless": lossless_equal(), "topk_max_diff": topk_matches_core()}
    # 0.005 MiB: two buckets; other names, so that neither rank's layout was agreed before (ranks
    # compare a layout once, deepreduce.collective.agreement)
    mixed = Reducer(build(TOPK), bucket_cap_mb=1.0 if hvd.rank() == 0 else 0.005)
    result["mixed"] = error_of(lambda: reduce(mixed, gradients(0), 0, names=[f"mixed_{n}" for n in NAMES]))
    result["summable"] = error_of(lambda: Reducer(None, hvd_compression=hvd.Compression.fp16, bucket_cap_mb=1.0))
    assert result["mixed"][0] == CommunicationError.__name__ and result["summable"][0] == ConfigError.__name__
    if hvd.rank() == 0:
        with open(sys.argv[1], "w", encoding="utf-8") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    main()
