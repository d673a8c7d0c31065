"""Every (index codec, value codec) pair in the registry round-trips through a pipeline.

The pairs are enumerated from the registry, so codecs are covered as they appear. Lossless
pairs must reproduce the sparsifier's output exactly; lossy ones must decode to a finite tensor
of the right shape whose support lies inside the set the index codec chose, identically on a
second decode (a receiver with a fresh pipeline).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepreduce import registry
from deepreduce.config import build
from deepreduce.wire import container

LOSSLESS_INDEX = {"raw", "rle", "huffman", "delta", "delta_huffman", "elias_fano"}
LOSSLESS_VALUE = {"raw", "deflate"}
PAIRS = [(i, v) for i in registry.ids("index") for v in registry.ids("value")]


def config(index, value, ratio):
    return {"sparsifier": {"id": "topk", "ratio": ratio}, "index": {"id": index},
            "value": {"id": value}, "memory": {"id": "none"}, "min_numel": 0}


ALWAYS_REORDER = ("polyfit", "dexp")


@pytest.mark.parametrize("index,value", PAIRS)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(1, 3000), ratio=st.sampled_from([0.001, 0.01, 0.1, 0.5]),
       seed=st.integers(0, 2**31), step=st.integers(0, 5))
def test_pair_round_trips(index, value, size, ratio, seed, step):
    rng = np.random.default_rng(seed)
    grad = rng.laplace(scale=10.0 ** rng.uniform(-6, 0), size=size).astype(np.float32)
    if value == "fp16":
        grad = np.clip(grad, -6e4, 6e4)
    pipe = build(config(index, value, ratio))
    payload = pipe.encode(grad, "t", step)
    out = pipe.decode(payload)
    assert out.shape == grad.shape and out.dtype == np.float32 and np.isfinite(out).all()
    receiver = build(config(index, value, ratio))
    np.testing.assert_array_equal(receiver.decode(payload), out)
    c = container.unpack(payload)
    reorders = not registry.get_class("index", index).keeps_order and not registry.get_class("value", value).keeps_order
    if value in ALWAYS_REORDER:
        assert c.permuted == (reorders and c.n > 0)
    else:                                   # deflate: a permutation only when it pays
        assert not c.permuted or reorders
    selected = pipe.sparsifier.select(grad, pipe.context("t", step))
    if index in LOSSLESS_INDEX:
        assert set(np.flatnonzero(out)) <= set(selected.tolist())
        if value in LOSSLESS_VALUE:
            expected = np.zeros_like(grad)
            expected[selected] = grad[selected]
            np.testing.assert_array_equal(out, expected)
