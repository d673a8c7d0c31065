"""The core pipeline: sparsifiers, raw codecs, small-tensor bypass, non-finite policy, memory."""
import numpy as np
import pytest

import deepreduce
from deepreduce import CommunicationError, DeepReduceError, NonFiniteGradientError
from deepreduce.wire import container


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


# ---------------------------------------------------------------------- decode into one buffer
def _sparse_pipe(index="raw", value="raw", ratio=0.05):
    return deepreduce.build(cfg({"id": "topk", "ratio": ratio}, value=value, index=index))


@pytest.mark.parametrize("index,value", [("raw", "raw"), ("elias_fano", "fp16"), ({"id": "bloom", "policy": "p0"}, "polyfit"),
                                         ("raw", "polyfit")])
def test_decode_sum_into_out_equals_the_sum_of_single_decodes(index, value):
    pipe = _sparse_pipe(index, value)
    parts = [pipe.encode(grad(seed=s), name="w") for s in range(3)]
    parts.append(deepreduce.build(dict(cfg({"id": "topk", "ratio": 0.05}), min_numel=10**6)).encode(grad(seed=9), name="w"))
    expected = np.zeros((50, 40), np.float32)
    for p in parts:
        expected += pipe.decode(p)
    out = np.full((50, 40), 7.0, np.float32)          # stale contents are overwritten
    got = pipe.decode_sum(parts, expected_shape=(50, 40), out=out)
    assert got.base is out or got is out
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(pipe.decode_sum(parts), expected)
    single = np.full(2000, 3.0, np.float32)
    pipe.decode(parts[0], out=single)
    np.testing.assert_array_equal(single.reshape(50, 40), pipe.decode(parts[0]))


def test_decode_out_must_fit():
    pipe = _sparse_pipe()
    payload = pipe.encode(grad(), name="w")
    with pytest.raises(CommunicationError, match="1999 elements"):
        pipe.decode_sum([payload], out=np.zeros(1999, np.float32))
    with pytest.raises(DeepReduceError, match="float32"):
        pipe.decode(payload, out=np.zeros(2000, np.float64))


def _raw_container(indices, numel=100):
    indices = np.asarray(indices)
    return container.pack(container.Container(
        shape=(numel,), n=indices.size, index_id=0, value_id=0,
        index_section=indices.astype("<u4").tobytes(), value_section=np.ones(indices.size, "<f4").tobytes()))


@pytest.mark.parametrize("indices,message", [([3, 9, 3], "repeats an index"), ([5, 100], "out of range"),
                                             ([7, 2, 7, 1], "repeats an index")])
def test_corrupted_containers_are_rejected(indices, message):
    pipe = _sparse_pipe()
    good = _raw_container([1, 2])
    with pytest.raises(deepreduce.ContainerError, match=message):
        pipe.decode(_raw_container(indices))
    with pytest.raises(deepreduce.ContainerError, match="rank 1: .*" + message):
        pipe.decode_sum([good, _raw_container(indices)], out=np.zeros(100, np.float32))


def test_unsorted_indices_are_rejected_where_the_codec_promises_ascending(monkeypatch):
    from deepreduce.index.elias_fano import EliasFanoIndex

    pipe = _sparse_pipe("elias_fano")
    payload = pipe.encode(grad(), name="w")
    original = EliasFanoIndex.decode
    monkeypatch.setattr(EliasFanoIndex, "decode", lambda self, *a: original(self, *a)[::-1].copy())
    with pytest.raises(deepreduce.ContainerError, match="not strictly ascending"):
        pipe.decode(payload)
    monkeypatch.setattr(EliasFanoIndex, "decode", lambda self, *a: np.repeat(original(self, *a)[:50], 2))
    with pytest.raises(deepreduce.ContainerError, match="not strictly ascending"):
        _sparse_pipe("elias_fano").decode_sum([payload])   # a receiver (the sender adds its own unparsed)


# ---------------------------------------------------------------------- threads option
def test_threads_option_is_validated_by_name_and_never_changes_a_byte():
    for bad in (0, -2, "many", 1.5, True):
        with pytest.raises(deepreduce.ConfigError, match="'threads'"):
            deepreduce.build(dict(cfg({"id": "topk", "ratio": 0.01}), threads=bad))
    one = deepreduce.build(dict(cfg({"id": "topk", "ratio": 0.01}, value="qsgd", memory="residual"), threads=1))
    four = deepreduce.build(dict(cfg({"id": "topk", "ratio": 0.01}, value="qsgd", memory="residual"), threads=4))
    assert four.get_config()["threads"] == 4 and four.threads == 4
    assert one._digest == four._digest  # the wire config digest leaves threads out
    assert one.sparsifier.threads == one.index.threads == one.value.threads == 1
    assert four.sparsifier.threads == four.index.threads == four.value.threads == 4
    rng = np.random.default_rng(5)
    for step in range(3):
        g = rng.standard_normal(300_000).astype(np.float32)
        a, b = one.encode(g, name="w", step=step), four.encode(g, name="w", step=step)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(one.decode_sum([a, b]), four.decode_sum([a, b]))
    np.testing.assert_array_equal(one.memory.residual("w"), four.memory.residual("w"))


def test_threads_auto_divides_the_cpus_among_local_ranks(monkeypatch):
    from deepreduce.backend import parallel

    monkeypatch.setattr(parallel, "usable_cpus", lambda: 16)
    for variable in parallel.LOCAL_SIZE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert parallel.resolve_threads("auto") == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert parallel.resolve_threads("auto") == 4
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "32")  # Open MPI's variable is read first
    assert parallel.resolve_threads("auto") == 1
    assert parallel.resolve_threads(3) == 3
    assert deepreduce.build(cfg({"id": "topk", "ratio": 0.01})).get_config()["threads"] == "auto"
