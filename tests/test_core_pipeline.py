"""The core pipeline: sparsifiers, raw codecs, small-tensor bypass, non-finite policy, memory."""
import numpy as np
import pytest

import deepreduce
from deepreduce import CommunicationError, DeepReduceError, NonFiniteGradientError, container


def cfg(sparsifier, value="raw", memory="none", **extra):
    return dict({"sparsifier": sparsifier, "index": "raw", "value": value, "memory": memory, "min_numel": 0}, **extra)


def grad(shape=(50, 40), seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_topk_keeps_the_largest_magnitudes():
    g = grad()
    out = deepreduce.build(cfg({"id": "topk", "ratio": 0.01})).decode(
        deepreduce.build(cfg({"id": "topk", "ratio": 0.01})).encode(g, name="w"))
    kept = np.flatnonzero(out)
    assert kept.size == 20
    assert np.abs(g.ravel()[kept]).min() >= np.sort(np.abs(g.ravel()))[-20]
    np.testing.assert_array_equal(out.ravel()[kept], g.ravel()[kept])


def test_none_sparsifier_is_exact_on_inherently_sparse_gradients():
    g = grad()
    g[np.abs(g) < 1.0] = 0.0
    pipe = deepreduce.build(cfg("none"))
    payload = pipe.encode(g, name="emb")
    np.testing.assert_array_equal(pipe.decode(payload), g)
    assert deepreduce.inspect(payload)["n"] == np.count_nonzero(g)


def test_randomk_is_seeded_by_config_name_and_step_only():
    g = grad()
    a, b = deepreduce.build(cfg({"id": "randomk", "ratio": 0.1})), deepreduce.build(cfg({"id": "randomk", "ratio": 0.1}))
    state = np.random.get_state()
    np.random.seed(123)
    first = a.encode(g, name="w", step=4)
    np.random.seed(999)
    assert np.array_equal(first, b.encode(g, name="w", step=4))       # same on every "rank"
    assert not np.array_equal(first, a.encode(g, name="w", step=5))   # new step, new draw
    assert not np.array_equal(first, a.encode(g, name="v", step=4))   # new tensor, new draw
    np.random.set_state(state)
    other = deepreduce.build(cfg({"id": "randomk", "ratio": 0.2}))
    assert deepreduce.inspect(other.encode(g, name="w", step=4))["n"] == 400


def test_randomk_leaves_global_rng_untouched():
    np.random.seed(7)
    expected = np.random.random()
    np.random.seed(7)
    deepreduce.build(cfg({"id": "randomk", "ratio": 0.1})).encode(grad(), name="w", step=1)
    assert np.random.random() == expected


def test_small_tensors_travel_dense():
    pipe = deepreduce.build(dict(cfg({"id": "topk", "ratio": 0.01}), min_numel=1000))
    g = grad((10, 10))
    payload = pipe.encode(g, name="bias")
    info = deepreduce.inspect(payload)
    assert info["dense"] and payload.size == container.overhead((10, 10), 100, value_bytes=400) + 400
    np.testing.assert_array_equal(pipe.decode(payload), g)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_gradients_reach_the_receiver(bad):
    pipe = deepreduce.build(cfg({"id": "topk", "ratio": 0.01}, memory="residual"))
    g = grad()
    g[3, 7] = bad
    payload = pipe.encode(g, name="w")
    assert deepreduce.inspect(payload)["nonfinite"]
    out = pipe.decode(payload)
    np.testing.assert_array_equal(out, g)  # NaN positions compare equal in assert_array_equal
    assert pipe.memory.residual("w") is None  # a skipped step does not poison the residual


def test_nonfinite_raise_policy_names_the_tensor():
    pipe = deepreduce.build(cfg({"id": "topk", "ratio": 0.01}, nonfinite="raise"))
    g = grad()
    g[0, 0] = np.nan
    g[1, 1] = np.inf
    with pytest.raises(NonFiniteGradientError, match=r"'fc.weight' at step 9 has 1 NaN and 1 Inf"):
        pipe.encode(g, name="fc.weight", step=9)


def test_residual_memory_keeps_what_was_not_sent():
    pipe = deepreduce.build(cfg({"id": "topk", "ratio": 0.05}, memory="residual"))
    g = grad()
    sent = pipe.decode(pipe.encode(g, name="w"))
    np.testing.assert_allclose(sent.ravel() + pipe.memory.residual("w"), g.ravel(), rtol=0, atol=1e-7)
    second = pipe.decode(pipe.encode(np.zeros_like(g), name="w"))
    assert np.count_nonzero(second) == 100  # the residual alone now drives the selection


def test_fp16_values_and_overflow_error():
    pipe = deepreduce.build(cfg({"id": "topk", "ratio": 0.1}, value="fp16"))
    g = grad()
    payload = pipe.encode(g, name="w")
    assert deepreduce.inspect(payload)["value_bytes"] == 2 * 200
    np.testing.assert_allclose(pipe.decode(payload), np.where(pipe.decode(payload) != 0, g, 0), rtol=1e-3)
    with pytest.raises(DeepReduceError, match="float16"):
        pipe.encode(g * 1e6, name="w")


def test_decode_checks_expected_shape_and_dtype():
    pipe = deepreduce.build(cfg({"id": "topk", "ratio": 0.1}))
    payload = pipe.encode(grad(), name="w")
    with pytest.raises(CommunicationError, match=r"shape \(50, 40\), expected \(40, 50\)"):
        pipe.decode(payload, expected_shape=(40, 50))
    with pytest.raises(CommunicationError, match="rank 1"):
        pipe.decode_sum([payload, pipe.encode(grad((4, 5)), name="w")])
    with pytest.raises(DeepReduceError, match="dtype int64"):
        pipe.encode(np.arange(10), name="ints")


def test_decode_sum_adds_every_rank():
    pipe = deepreduce.build(cfg("none"))
    parts = [pipe.encode(grad(seed=s), name="w") for s in range(3)]
    np.testing.assert_allclose(pipe.decode_sum(parts), sum(grad(seed=s) for s in range(3)), rtol=1e-6)


def test_stats_count_bytes_and_time():
    pipe = deepreduce.build(cfg({"id": "topk", "ratio": 0.01}))
    payload = pipe.encode(grad(), name="w")
    pipe.decode(payload)
    s = pipe.stats.as_dict()
    assert s["dense_bytes"] == 8000 and s["wire_bytes"] == payload.size
    assert s["index_bytes"] == s["value_bytes"] == 80
    assert s["relative_volume"] == payload.size / 8000 and s["encode_seconds"] > 0 and s["tensors_decoded"] == 1
