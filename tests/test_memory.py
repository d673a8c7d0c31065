"""Error feedback loses nothing: sum(sent) + final residual == sum(gradients)."""
import numpy as np
import pytest

import deepreduce
from deepreduce import registry

CASES = [
    ({"id": "topk", "ratio": 0.01}, {"id": "raw"}),
    ({"id": "topk", "ratio": 0.05}, {"id": "fp16"}),       # lossy values as well as dropped entries
    ({"id": "sidco", "ratio": 0.01}, {"id": "fp16"}),
    ({"id": "dgc", "ratio": 0.001}, {"id": "raw"}),
    ({"id": "randomk", "ratio": 0.02}, {"id": "fp16"}),
    ({"id": "threshold", "threshold": 2e-3}, {"id": "raw"}),
]


@pytest.mark.parametrize("sparsifier,value", CASES, ids=lambda c: c["id"])
def test_conservation_over_many_steps(sparsifier, value):
    pipe = deepreduce.build({"sparsifier": sparsifier, "index": {"id": "raw"}, "value": value,
                             "memory": {"id": "residual"}})
    rng = np.random.default_rng(1)
    d, steps = 20_000, 150
    sum_grad = {n: np.zeros(d) for n in ("a", "b")}
    sum_sent = {n: np.zeros(d) for n in ("a", "b")}
    for step in range(steps):
        for name, scale in (("a", 1e-3), ("b", 3.0)):
            g = (rng.laplace(scale=scale, size=d) + scale * 0.1).astype(np.float32)   # a drift makes residuals grow
            sum_grad[name] += g
            sum_sent[name] += pipe.decode(pipe.encode(g, name=name, step=step))
    for name in ("a", "b"):
        residual = pipe.memory.residual(name)
        assert residual.dtype == np.float64
        scale = np.abs(sum_grad[name]).max()
        err = np.abs(sum_sent[name] + residual - sum_grad[name]).max()
        # float64 bookkeeping: only float64 rounding of the running sums remains
        assert err <= 1e-12 * scale * steps, (name, err, scale)
        assert np.abs(residual).max() > 0  # something really was held back


def test_dense_small_tensors_and_reset():
    pipe = deepreduce.build({"sparsifier": {"id": "topk", "ratio": 0.1}, "index": {"id": "raw"},
                             "value": {"id": "fp16"}, "memory": {"id": "residual"}, "min_numel": 100})
    g = np.linspace(-1, 1, 50, dtype=np.float32) / 3
    total = np.zeros(50)
    for step in range(5):
        total += pipe.decode(pipe.encode(g, name="small", step=step))
    np.testing.assert_allclose(total + pipe.memory.residual("small"), 5 * g.astype(np.float64), rtol=0, atol=1e-13)
    pipe.memory.reset()
    assert pipe.memory.residual("small") is None


def test_memory_reports_size_change():
    mem = registry.create("memory", {"id": "residual"})
    x = np.ones(4, np.float32)
    mem.update("t", mem.compensate("t", x), np.zeros(4, np.float32))
    with pytest.raises(deepreduce.CommunicationError, match="keep its size"):
        mem.compensate("t", np.ones(5, np.float32))
