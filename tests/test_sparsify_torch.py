"""The sparsifiers, written once on the array namespace, select on torch tensors (what non-CPU
devices run, tested here on CPU tensors) exactly what they select on NumPy arrays with the C++
kernels; a NumPy-only sparsifier runs on a host copy (and DGC/threshold basics)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepreduce import registry
from deepreduce.pipeline import select_positions
from deepreduce.wire.seeding import EncodeContext, config_digest

CONFIGS = [
    {"id": "none"},
    {"id": "topk", "ratio": 0.01},
    {"id": "topk", "ratio": 0.3},
    {"id": "randomk", "ratio": 0.05},
    {"id": "threshold", "threshold": 1.5e-3},
    {"id": "dgc", "ratio": 0.01},
    {"id": "dgc", "ratio": 0.001, "sample_ratio": 0.05},
    {"id": "sidco", "ratio": 0.01},
    {"id": "sidco", "ratio": 0.001, "distribution": "gamma", "stages": 3},
    {"id": "sidco", "ratio": 0.01, "distribution": "gpareto", "adapt": "reversed"},
]


def ctx(step, name="layer"):
    return EncodeContext(config_digest({"case": "torch"}), name, step)


def gradient(rng, d, zeros=0.0, ties=False):
    g = rng.laplace(scale=1e-3, size=d).astype(np.float32)
    if ties:  # coarse values: many equal magnitudes at every cut
        g = np.round(g * 2e3).astype(np.float32) / np.float32(2e3)
    if zeros:
        g[rng.random(d) < zeros] = 0
    return g


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_torch_selects_like_numpy_over_steps(config):
    rng = np.random.default_rng(11)
    sp_np, sp_t = registry.create("sparsifier", config), registry.create("sparsifier", config)
    for step in range(8):
        g = gradient(rng, 50_000, zeros=0.3 if step % 2 else 0.0, ties=step % 3 == 0)
        want = sp_np.select(g, ctx(step))
        got = sp_t.select(torch.from_numpy(g), ctx(step))
        assert got.dtype == torch.int64
        np.testing.assert_array_equal(got.numpy(), want)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1.0, -1.0, 2.0, 0.5, -0.5, 3.0]), min_size=1, max_size=300),
       st.floats(0.001, 1.0))
def test_topk_ties_go_to_lowest_positions(values, ratio):
    g = np.array(values, dtype=np.float32)
    sp = registry.create("sparsifier", {"id": "topk", "ratio": ratio})
    want = sp.select(g, ctx(0))
    np.testing.assert_array_equal(sp.select(torch.from_numpy(g), ctx(0)).numpy(), want)
    # reference: stable sort by descending magnitude, keep the first r, ascending
    order = np.argsort(-np.abs(g), kind="stable")[: want.size]
    np.testing.assert_array_equal(np.sort(order), want)


def test_dgc_is_seeded_and_never_exceeds_target():
    rng = np.random.default_rng(5)
    g = gradient(rng, 200_000)
    sp = registry.create("sparsifier", {"id": "dgc", "ratio": 0.01})
    a, b = sp.select(g, ctx(3)), sp.select(g, ctx(3))
    np.testing.assert_array_equal(a, b)
    assert a.size <= 2000
    counts = [sp.select(g, ctx(s)).size / 2000 for s in range(10)]
    assert 0.7 < np.mean(counts) <= 1.0
    # everything DGC keeps is at least as large as everything it drops
    mask = np.zeros(g.size, bool)
    mask[a] = True
    assert np.abs(g[mask]).min() >= np.abs(g[~mask]).max()


def test_threshold_selects_by_magnitude():
    g = np.array([0.1, -2.0, 0.5, 1.0, -1.0, 0.0], np.float32)
    sp = registry.create("sparsifier", {"id": "threshold", "threshold": 1.0})
    assert sp.select(g, ctx(0)).tolist() == [1, 3, 4]
    assert registry.create("sparsifier", {"id": "threshold", "threshold": 5.0}).select(g, ctx(0)).size == 0


def test_a_numpy_only_sparsifier_runs_on_a_host_copy_of_a_tensor():
    sp = registry.create("sparsifier", {"id": "topk", "ratio": 0.5})

    class Odd(type(sp)):
        array_api = False

        def select(self, flat, c):
            assert isinstance(flat, np.ndarray)
            return np.array([0, 2], dtype=np.int64)

    with pytest.warns(RuntimeWarning, match="runs on the host"):
        got = select_positions(Odd(ratio=0.5), torch.ones(4), ctx(0))
    assert isinstance(got, torch.Tensor) and got.tolist() == [0, 2]


def test_every_builtin_sparsifier_is_written_on_the_array_namespace():
    for id_ in registry.ids("sparsifier"):
        assert registry.get_class("sparsifier", id_).array_api, id_
