"""Regenerate the golden wire fixtures of the current container format (v2): one per config in
configs/ (plus the core's own).

Run only when the wire format changes on purpose (and bump the container version then):

    .venv/bin/python tests/golden/make_golden.py                  # every fixture
    .venv/bin/python tests/golden/make_golden.py config_NAME      # only these (a config just added)

Each fixture ``tests/golden/<name>.npz`` holds the config (JSON), the gradient, the tensor
name and step, the container bytes and the tensor they decode to. tests/test_golden.py checks
that encoding the gradient still gives exactly these bytes and that decoding them still gives
the same tensor. ``tests/golden/v1/`` keeps the format-v1 fixtures (written by the v1 code, with
the tensors the v1 code decoded them to): they are decode-only and never regenerated.
"""
from __future__ import annotations

import glob
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

import deepreduce  # noqa: E402

EXTRA = {
    "core_topk_fp16": {"sparsifier": {"id": "topk", "ratio": 0.02}, "index": {"id": "raw"},
                       "value": {"id": "fp16"}, "memory": {"id": "none"}},
    "core_randomk_raw": {"sparsifier": {"id": "randomk", "ratio": 0.02}, "index": {"id": "raw"},
                         "value": {"id": "raw"}, "memory": {"id": "none"}},
    "core_dense_small": {"sparsifier": {"id": "topk", "ratio": 0.02}, "index": {"id": "raw"},
                         "value": {"id": "raw"}, "memory": {"id": "none"}, "min_numel": 100000},
}


def fixture_gradient() -> np.ndarray:
    """A 16x32x3x3 (4,608-element) gradient with a Laplace body and some exact zeros."""
    rng = np.random.default_rng(20240521)
    grad = rng.laplace(scale=1e-2, size=(16, 32, 3, 3)).astype(np.float32)
    grad[rng.random(grad.shape) < 0.3] = 0.0
    return grad


def golden_configs() -> dict:
    configs = {f"config_{os.path.splitext(os.path.basename(p))[0]}": deepreduce.load_config(p)
               for p in sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))}
    configs.update({k: deepreduce.load_config(v) for k, v in EXTRA.items()})
    return configs


def main(names=()) -> None:
    """Write the fixtures named in ``names`` (every one when empty)."""
    grad = fixture_gradient()
    configs = golden_configs()
    unknown = sorted(set(names) - set(configs))
    if unknown:
        raise SystemExit(f"no config for fixture(s) {', '.join(unknown)}; known: {', '.join(configs)}")
    for name, config in configs.items():
        if names and name not in names:
            continue
        step = max(7, config["warmup"])   # a step after any warm-up: the sparse container is what is frozen
        payload = deepreduce.build(config).encode(grad, name="golden.weight", step=step)
        np.savez_compressed(os.path.join(HERE, f"{name}.npz"), config=json.dumps(config, sort_keys=True),
                            grad=grad, tensor_name="golden.weight", step=step, payload=payload,
                            decoded=deepreduce.build(config).decode(payload))
        print(f"{name}: {payload.size} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
