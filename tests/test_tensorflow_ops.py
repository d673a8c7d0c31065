"""The TensorFlow custom ops (csrc/*/tf_*.cpp): same results as the NumPy twins of the C++
kernels, clean failures on bad input, and the TF pipeline routing Bloom/fit work through them
with the core's exact bytes.

The ops are built by ``make setup`` (scripts/build_tf_ops.sh); without them these tests are
skipped with that instruction (the rest of the TF binding falls back to numpy_function).
"""
import glob
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

tf = pytest.importorskip("tensorflow")

import deepreduce  # noqa: E402
import deepreduce.tensorflow as drtf  # noqa: E402
from deepreduce.index import bloom as bloom_codec  # noqa: E402
from deepreduce.tensorflow import ops  # noqa: E402
from deepreduce.values import polyfit as polyfit_codec  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:
    OPS = ops.load()   # loadable even when DEEPREDUCE_BACKEND=numpy; the tests below ask for "tf-ops"
except deepreduce.BackendUnavailableError as exc:
    pytest.skip(f"TensorFlow custom ops are not available: {exc}", allow_module_level=True)
U64 = (1 << 64) - 1


def as_i64(x):
    return x - (1 << 64) if x >= (1 << 63) else x


@pytest.fixture(scope="module")
def filter_case():
    rng = np.random.default_rng(3)
    d = 50_000
    idx = np.sort(rng.choice(d, 500, replace=False)).astype(np.int64)
    blocks, k = bloom_codec.filter_params(idx.size, 0.01)
    return idx, d, blocks, k, 0xDEADBEEFCAFEF00D


def test_bloom_build_and_query_match_numpy_twin(filter_case):
    idx, d, blocks, k, seed = filter_case
    bits = OPS.deep_reduce_bloom_build(idx, blocks, k, as_i64(seed)).numpy()
    assert bits.tobytes() == bloom_codec.np_build(idx.astype(np.uint64), blocks, k, seed)
    positives = OPS.deep_reduce_bloom_query(bits, blocks, k, as_i64(seed), d, d).numpy()
    expected = bloom_codec.np_query(bits.tobytes(), blocks, k, seed, d, d).astype(np.int64)
    np.testing.assert_array_equal(positives, expected)
    assert np.isin(idx, positives).all() and positives.size > idx.size   # no false negatives, some FPs
    # early exit: with a limit the query may stop, but returns a prefix with more than `limit`
    short = OPS.deep_reduce_bloom_query(bits, blocks, k, as_i64(seed), d, 10).numpy()
    assert short.size > 10 and np.array_equal(short, positives[:short.size])


@pytest.mark.parametrize("policy", bloom_codec.POLICIES)
def test_bloom_select_matches_the_codec_policies(filter_case, policy):
    idx, d, blocks, k, seed = filter_case
    draw = 0xFEDCBA9876543210
    bits = bloom_codec.np_build(idx.astype(np.uint64), blocks, k, seed)
    P = bloom_codec.np_query(bits, blocks, k, seed, d, d)
    r = idx.size
    got = OPS.deep_reduce_bloom_select(P.astype(np.int64), r, blocks, k, as_i64(seed), as_i64(draw), policy=policy).numpy()
    if policy == "p1":
        expected = bloom_codec.np_select_random(P, r, draw)
    elif policy == "p2":
        expected = bloom_codec.np_select_conflict(P, r, blocks, k, seed, draw)
    else:
        params = bloom_codec.BloomParams("blocked", policy, k, blocks, seed, draw)
        expected = bloom_codec.BloomIndex(policy=policy)._select(None, params, P, r)
    np.testing.assert_array_equal(got, np.asarray(expected).astype(np.int64))


@pytest.mark.parametrize("coef_bytes", [4, 8])
def test_fit_encode_decode_match_numpy_twin(coef_bytes):
    values = np.random.default_rng(5).standard_normal(3000).astype(np.float32)
    perm, payload = OPS.deep_reduce_fit_encode(values, degree=5, max_segments=4, min_points=20, coef_bytes=coef_bytes)
    ref_perm, ref_payload = polyfit_codec.encode_numpy(values, 5, 4, 20, coef_bytes)
    np.testing.assert_array_equal(perm.numpy(), ref_perm)
    assert payload.numpy().tobytes() == ref_payload
    decoded = OPS.deep_reduce_fit_decode(payload, values.size, degree=5, coef_bytes=coef_bytes).numpy()
    np.testing.assert_array_equal(decoded, polyfit_codec.decode_numpy(ref_payload, values.size, 5, coef_bytes))


def test_bad_input_fails_the_op_without_crashing(filter_case):
    idx, d, blocks, k, seed = filter_case
    seed = as_i64(seed)
    bits = OPS.deep_reduce_bloom_build(idx, blocks, k, seed)
    with pytest.raises(tf.errors.InvalidArgumentError, match="bytes, expected"):
        OPS.deep_reduce_bloom_query(bits[:-1], blocks, k, seed, d, d)
    with pytest.raises(tf.errors.InvalidArgumentError, match="k in"):
        OPS.deep_reduce_bloom_build(idx, blocks, 0, seed)
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-negative"):
        OPS.deep_reduce_bloom_build(tf.constant([-1], tf.int64), blocks, k, seed)
    with pytest.raises(tf.errors.InvalidArgumentError, match="requested"):
        OPS.deep_reduce_bloom_select(tf.constant([1, 2], tf.int64), 3, blocks, k, seed, 0, policy="p1")
    garbage = np.random.default_rng(0).integers(0, 256, 40).astype(np.uint8)
    with pytest.raises(tf.errors.InvalidArgumentError, match="polyfit decode"):
        OPS.deep_reduce_fit_decode(garbage, 1000, degree=5, coef_bytes=4)
    with pytest.raises(tf.errors.InvalidArgumentError, match="coef_bytes"):
        OPS.deep_reduce_fit_encode(np.ones(30, np.float32), degree=2, max_segments=1, min_points=3, coef_bytes=2)


def _op_types(concrete):
    """Every op type in a concrete function's graph, including its branch functions."""
    graph_def = concrete.graph.as_graph_def()
    types = {node.op for node in graph_def.node}
    for function in graph_def.library.function:
        types.update(node.op for node in function.node_def)
    return types


BLOOM_CONFIGS = [{"sparsifier": {"id": "topk", "ratio": 0.02}, "index": {"id": "bloom", "policy": p, "fpr": 0.01},
                  "value": {"id": v}, "memory": {"id": "residual"}}
                 for p in bloom_codec.POLICIES for v in ("raw", "polyfit")]
OPS_CONFIGS = [c for c in sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
               if ops.OpsEncoder.routes(deepreduce.build(c))] + BLOOM_CONFIGS + [
    {"sparsifier": {"id": "topk", "ratio": 0.02}, "index": {"id": "raw"}, "value": {"id": "polyfit"},
     "memory": {"id": "none"}}]


@pytest.mark.parametrize("config", OPS_CONFIGS, ids=lambda c: os.path.basename(c) if isinstance(c, str)
                         else f"{c['index'].get('policy', c['index']['id'])}-{c['value']['id']}")
def test_pipeline_routes_codec_work_through_ops_with_core_bytes(config, monkeypatch):
    tf_pipe, core = drtf.build(config, backend="tf-ops"), deepreduce.build(config)
    bloom, fit = ops.OpsEncoder.routed_codecs(tf_pipe.core)
    assert tf_pipe.backend == "tf-ops" and (bloom or fit)

    def refuse(*args, **kwargs):
        raise AssertionError("the Python codec ran: the TF pipeline did not use the custom op")

    if bloom:   # the TF pipeline must not call the Python Bloom encode at all ...
        monkeypatch.setattr(type(tf_pipe.core.index), "encode", refuse)
    encode = tf.function(lambda x, s: tf_pipe.encode(x, name="conv", step=s))
    rng = np.random.default_rng(11)
    shape = (64, 64, 3, 3)
    for step in range(3):
        g = (rng.standard_normal(shape) * 0.01).astype(np.float32)
        got = encode(tf.constant(g), tf.constant(step, tf.int64)).numpy()
        monkeypatch.undo()
        expected = core.encode(g, name="conv", step=step)   # ... while the core does
        if bloom:
            monkeypatch.setattr(type(tf_pipe.core.index), "encode", refuse)
        assert np.array_equal(got, expected), f"step {step}"
    monkeypatch.undo()
    types = _op_types(encode.get_concrete_function(tf.TensorSpec(shape), tf.TensorSpec([], tf.int64)))
    if bloom:
        assert {"DeepReduceBloomBuild", "DeepReduceBloomQuery", "DeepReduceBloomSelect"} <= types
    if fit:
        assert "DeepReduceFitEncode" in types
    # residual memories advanced identically on both sides
    if tf_pipe.core.memory.stateful:
        np.testing.assert_array_equal(tf_pipe.core.memory.residual("conv"), core.memory.residual("conv"))
    # small and non-finite tensors take the dense branch, as in the core
    small = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert np.array_equal(tf_pipe.encode(small, name="b", step=0).numpy(), core.encode(small, name="b", step=0))


def test_forced_numpy_backend_skips_the_ops(monkeypatch):
    monkeypatch.setenv("DEEPREDUCE_BACKEND", "numpy")
    assert drtf.build(os.path.join(ROOT, "configs", "bf_p0.yaml")).backend == "numpy_function"


def test_backend_choice():
    path = os.path.join(ROOT, "configs", "bf_p2.yaml")
    assert drtf.build(path, backend="tf-ops").backend == "tf-ops"
    forced = drtf.build(path, backend="numpy_function")
    assert forced.backend == "numpy_function"
    g = np.random.default_rng(2).standard_normal(5000).astype(np.float32)
    assert np.array_equal(forced.encode(g, name="x", step=4).numpy(), deepreduce.build(path).encode(g, name="x", step=4))
    with pytest.raises(deepreduce.ConfigError, match="tf-ops"):
        drtf.build(os.path.join(ROOT, "configs", "topk_raw.yaml"), backend="tf-ops")
    with pytest.raises(deepreduce.ConfigError, match="allowed"):
        drtf.build(path, backend="gpu")


@pytest.mark.parametrize("policy", bloom_codec.POLICIES)
def test_graph_decode_queries_and_selects_with_the_ops(policy, monkeypatch):
    config = {"sparsifier": {"id": "topk", "ratio": 0.02}, "index": {"id": "bloom", "policy": policy, "fpr": 0.01},
              "value": {"id": "raw"}, "memory": {"id": "none"}}
    core, tf_pipe = deepreduce.build(config), drtf.build(config, backend="tf-ops")
    rng = np.random.default_rng(21)
    grads = [(rng.standard_normal(8000) * 0.01).astype(np.float32) for _ in range(3)]
    grads[2][:10] = 0   # still sparse; a NaN tensor travels dense:
    grads.append(np.full(8000, np.nan, np.float32))
    payloads = [core.encode(g, name="w", step=s) for s, g in enumerate(grads)]
    # a container of another policy (e.g. another config) is decoded by the core's decoder
    other = "p1" if policy != "p1" else "p2"
    foreign = deepreduce.build(dict(config, index={"id": "bloom", "policy": other, "fpr": 0.01}))
    payloads.append(foreign.encode(grads[0], name="w", step=9))
    calls = []
    real = bloom_codec.BloomIndex.decode
    monkeypatch.setattr(bloom_codec.BloomIndex, "decode", lambda self, *a: calls.append(1) or real(self, *a))
    decode_sum = tf.function(lambda b: tf_pipe.decode_sum(b, (8000,), count=len(payloads)))
    decode_one = tf.function(lambda b: tf_pipe.decode(b, (8000,)))
    got = decode_sum(tf.constant(np.concatenate(payloads))).numpy()
    one = decode_one(tf.constant(payloads[0])).numpy()
    assert calls == [1]   # only the foreign container went through the Python decoder
    monkeypatch.undo()
    np.testing.assert_array_equal(got, core.decode_sum(payloads, (8000,)))
    np.testing.assert_array_equal(one, core.decode(payloads[0]))
    types = _op_types(decode_sum.get_concrete_function(tf.TensorSpec([None], tf.uint8)))
    assert {"DeepReduceBloomQuery", "DeepReduceBloomSelect"} <= types
    # a header count that the filter cannot back fails with the core's message
    import deepreduce.container as ct

    header = ct.unpack(payloads[0])
    header.n = 8000   # n = numel
    bad = ct.pack(header)
    with pytest.raises(tf.errors.OpError, match="positives|values"):
        decode_one(tf.constant(bad))
    with pytest.raises(tf.errors.OpError, match="containers for"):
        decode_sum(tf.constant(payloads[0]))


@pytest.mark.parametrize("index", ["raw", "bloom"])
def test_graph_decode_runs_polyfit_decode_as_op(index, monkeypatch):
    config = {"sparsifier": {"id": "topk", "ratio": 0.05}, "index": {"id": index},
              "value": {"id": "polyfit", "degree": 3, "segments": 4}, "memory": {"id": "none"}}
    core, tf_pipe = deepreduce.build(config), drtf.build(config, backend="tf-ops")
    rng = np.random.default_rng(8)
    grads = [(rng.standard_normal(6000) * 0.01).astype(np.float32) for _ in range(2)] + [np.zeros(10, np.float32)]
    payloads = [core.encode(g, name="w", step=s) for s, g in enumerate(grads[:2])]
    calls = []
    real = polyfit_codec.PolyFit.decode
    monkeypatch.setattr(polyfit_codec.PolyFit, "decode", lambda self, *a: calls.append(1) or real(self, *a))
    decode_sum = tf.function(lambda b: tf_pipe.decode_sum(b, (6000,), count=2))
    got = decode_sum(tf.constant(np.concatenate(payloads))).numpy()
    assert calls == []
    monkeypatch.undo()
    np.testing.assert_array_equal(got, core.decode_sum(payloads, (6000,)))
    assert "DeepReduceFitDecode" in _op_types(decode_sum.get_concrete_function(tf.TensorSpec([None], tf.uint8)))
    # a value section cut short (lengths fixed up, CRC recomputed) fails the op, never crashes
    import deepreduce.container as ct

    c = ct.unpack(payloads[0])
    c.value_section = c.value_section[:-4]
    short = ct.pack(c)
    decode_one = tf.function(lambda b: tf_pipe.decode(b, (6000,)))
    with pytest.raises(tf.errors.OpError, match="polyfit"):
        decode_one(tf.constant(short))


from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_PROPERTY_PIPES = {}


def _property_pipe(policy, value):
    key = (policy, value)
    if key not in _PROPERTY_PIPES:
        config = {"sparsifier": {"id": "randomk", "ratio": 0.03}, "index": {"id": "bloom", "policy": policy, "fpr": 0.02},
                  "value": {"id": value}, "memory": {"id": "none"}}
        tf_pipe = drtf.build(config, backend="tf-ops")
        spec = [tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.int64)]
        encode = tf.function(lambda x, s: tf_pipe.encode(x, name="p", step=s), input_signature=spec)
        decode = tf.function(lambda b: tf_pipe.decode(b), input_signature=[tf.TensorSpec([None], tf.uint8)])
        _PROPERTY_PIPES[key] = (deepreduce.build(config), encode, decode)
    return _PROPERTY_PIPES[key]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(bloom_codec.POLICIES), value=st.sampled_from(["raw", "polyfit"]),
       size=st.integers(1000, 20000), seed=st.integers(0, 2**32 - 1), step=st.integers(0, 2**40))
def test_property_ops_path_writes_and_reads_the_cores_bytes(policy, value, size, seed, step):
    core, encode, decode = _property_pipe(policy, value)
    g = np.random.default_rng(seed).standard_normal(size).astype(np.float32)
    payload = encode(tf.constant(g), tf.constant(step, tf.int64)).numpy()
    expected = core.encode(g, name="p", step=step)
    assert np.array_equal(payload, expected)
    np.testing.assert_array_equal(decode(tf.constant(payload)).numpy(), core.decode(expected))
