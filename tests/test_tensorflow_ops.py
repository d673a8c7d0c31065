"""The TensorFlow pipeline ops (csrc/tf/tf_pipeline_ops.cpp): one op encodes a tensor and one op
decodes containers, with the core's exact bytes, residuals and checks, for every config whose
stages exist in C++; every other config runs as one numpy_function stage per direction.

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
from deepreduce.wire import container  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:
    ops.load()   # loadable even when DEEPREDUCE_BACKEND=numpy; the tests below ask for "tf-ops"
except deepreduce.BackendUnavailableError as exc:
    pytest.skip(f"TensorFlow custom ops are not available: {exc}", allow_module_level=True)

FILE_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
OPS_FILE_CONFIGS = [c for c in FILE_CONFIGS if ops.unsupported(deepreduce.build(c)) is None]
NUMPY_FILE_CONFIGS = [c for c in FILE_CONFIGS if c not in OPS_FILE_CONFIGS]


def config(index="raw", policy="p0", value="raw", memory="residual", ratio=0.02, **extra):
    idx = {"id": "bloom", "policy": policy, "fpr": 0.01} if index == "bloom" else {"id": index}
    return {"sparsifier": {"id": "topk", "ratio": ratio}, "index": idx, "value": {"id": value},
            "memory": {"id": memory}, **extra}


VALUES = ("raw", "fp16", "polyfit")
OPS_CONFIGS = OPS_FILE_CONFIGS + [config("raw", value=v, memory=m) for v in VALUES for m in ("none", "residual")] \
    + [config("bloom", p, v, m) for p in bloom_codec.POLICIES for v in VALUES for m in ("none", "residual")] \
    + [dict(config(i, "p1", v), sparsifier={"id": "threshold", "threshold": 0.02})
       for i in ("raw", "bloom") for v in ("raw", "polyfit")] \
    + [dict(config("bloom", "p2", memory="none"), value={"id": "polyfit", "degree": 3, "segments": 2,
                                                         "min_points": 40, "coef_dtype": "float64"})]


def config_id(c):
    if isinstance(c, str):
        return os.path.basename(c)
    return f"{c['index'].get('policy', c['index']['id'])}-{c['value']['id']}-{c['memory']['id']}"


def op_types(concrete):
    """Every op type in a concrete function's graph, including its branch functions."""
    graph_def = concrete.graph.as_graph_def()
    types = [node.op for node in graph_def.node]
    for function in graph_def.library.function:
        types += [node.op for node in function.node_def]
    return types


def test_every_config_with_topk_raw_or_bloom_and_raw_fp16_or_polyfit_qualifies():
    names = {os.path.basename(c) for c in OPS_FILE_CONFIGS}
    assert {"topk_raw.yaml", "bf_p0.yaml", "bf_p1.yaml", "bf_p2.yaml", "bf_naive.yaml", "polyfit.yaml",
            "threshold.yaml"} <= names
    assert "qsgd" in ops.unsupported(deepreduce.build(os.path.join(ROOT, "configs", "qsgd.yaml")))


@pytest.mark.parametrize("cfg", OPS_CONFIGS, ids=config_id)
def test_one_op_per_direction_writes_and_reads_the_cores_bytes(cfg):
    tf_pipe, core, peer = drtf.build(cfg, backend="tf-ops"), deepreduce.build(cfg), deepreduce.build(cfg)
    encode = tf.function(lambda x, s: tf_pipe.encode(x, name="conv", step=s))
    decode = tf.function(lambda b: tf_pipe.decode_sum(b, (64, 64, 3, 3), count=2))
    rng = np.random.default_rng(11)
    for step in range(3):
        g = (rng.standard_normal((64, 64, 3, 3)) * 0.01).astype(np.float32)
        g[0, 0] = -0.0   # signed zeros travel as they are
        got = encode(tf.constant(g), tf.constant(step, tf.int64)).numpy()
        expected = core.encode(g, name="conv", step=step)
        assert np.array_equal(got, expected), f"step {step}"
        both = np.concatenate([expected, peer.encode(g[::-1].copy(), name="conv", step=step)])
        np.testing.assert_array_equal(decode(tf.constant(both)).numpy(),
                                      core.decode_sum(container.split(both), (64, 64, 3, 3)))
    if core.memory.stateful:   # the residual advanced exactly as the core's
        np.testing.assert_array_equal(tf_pipe.residual("conv"), core.memory.residual("conv"))
    enc_types = op_types(encode.get_concrete_function(tf.TensorSpec((64, 64, 3, 3)), tf.TensorSpec([], tf.int64)))
    dec_types = op_types(decode.get_concrete_function(tf.TensorSpec([None], tf.uint8)))
    assert enc_types.count("DeepReduceEncode") == 1 and dec_types.count("DeepReduceDecode") == 1
    assert not {"PyFunc", "EagerPyFunc", "StatelessIf", "If"} & set(enc_types + dec_types)
    # small tensors travel dense, non-finite ones dense and unchanged, as in the core (eagerly too)
    small = np.arange(12, dtype=np.float32).reshape(3, 4) - 6
    assert np.array_equal(tf_pipe.encode(small, name="b", step=0).numpy(), core.encode(small, name="b", step=0))
    bad = (rng.standard_normal(5000) * 0.01).astype(np.float32)
    bad[7] = np.nan
    for step in range(2):   # first without a residual, then with one
        assert np.array_equal(tf_pipe.encode(bad, name="nan", step=step).numpy(),
                              core.encode(bad, name="nan", step=step))
        bad[7] = 0.5
    stats, reference = tf_pipe.compression_stats(), core.stats.as_dict()
    for key in ("tensors_encoded", "dense_bytes", "wire_bytes", "index_bytes", "value_bytes", "header_bytes"):
        assert stats[key] == reference[key], key
    assert stats["tensors_decoded"] == 6 and stats["encode_seconds"] > 0


@pytest.mark.parametrize("cfg", NUMPY_FILE_CONFIGS, ids=config_id)
def test_other_configs_run_one_numpy_stage_per_direction(cfg):
    tf_pipe, core = drtf.build(cfg), deepreduce.build(cfg)
    assert tf_pipe.backend == "numpy_function"
    encode = tf.function(lambda x: tf_pipe.encode(x, name="w", step=3))
    decode = tf.function(lambda b: tf_pipe.decode_sum(b, (5000,), count=1))
    g = (np.random.default_rng(4).standard_normal(5000) * 0.01).astype(np.float32)
    payload = encode(tf.constant(g)).numpy()
    assert np.array_equal(payload, core.encode(g, name="w", step=3))
    np.testing.assert_array_equal(decode(tf.constant(payload)).numpy(), core.decode(payload))
    for fn, spec in ((encode, tf.TensorSpec([5000])), (decode, tf.TensorSpec([None], tf.uint8))):
        types = op_types(fn.get_concrete_function(spec))
        assert types.count("PyFunc") == 1 and not {"If", "StatelessIf"} & set(types)


def test_backend_choice(monkeypatch):
    path = os.path.join(ROOT, "configs", "bf_p2.yaml")
    assert drtf.build(path).backend == "tf-ops"
    assert drtf.build(path, backend="numpy_function").backend == "numpy_function"
    with pytest.raises(deepreduce.ConfigError, match="qsgd"):
        drtf.build(os.path.join(ROOT, "configs", "qsgd.yaml"), backend="tf-ops")
    with pytest.raises(deepreduce.ConfigError, match="allowed"):
        drtf.build(path, backend="gpu")
    monkeypatch.setenv("DEEPREDUCE_BACKEND", "numpy")
    assert drtf.build(path).backend == "numpy_function"


def test_decode_checks_fail_with_the_cores_messages():
    cfg = config("bloom", "p1", memory="none")
    core, tf_pipe = deepreduce.build(cfg), drtf.build(cfg, backend="tf-ops")
    g = (np.random.default_rng(21).standard_normal(8000) * 0.01).astype(np.float32)
    payload = core.encode(g, name="w", step=0)
    graph_decode = tf.function(lambda b: tf_pipe.decode_sum(b, (8000,), count=2))
    with pytest.raises(tf.errors.OpError, match="allgather returned 1 containers for 2 ranks"):
        graph_decode(tf.constant(payload))
    # eagerly the deepreduce error class comes back, with the core's text
    for damage, error in ((lambda c: setattr(c, "n", 8000), "positives"),
                          (lambda c: setattr(c, "index_section", c.index_section[:-1]), "Bloom section has"),
                          (lambda c: setattr(c, "value_section", c.value_section[:-4]), "raw value section")):
        c = container.unpack(payload)
        damage(c)
        bad = container.pack(c)
        with pytest.raises(deepreduce.ContainerError) as got:
            tf_pipe.decode(bad, (8000,))
        with pytest.raises(deepreduce.ContainerError) as expected:
            core.decode(bad, (8000,))
        assert error in str(got.value) and str(got.value) == str(expected.value)
    corrupt = payload.copy()
    corrupt[30] ^= 1
    with pytest.raises(deepreduce.ContainerError, match="checksum"):
        tf_pipe.decode(corrupt)
    reshaped = core.encode(g.reshape(80, 100), name="v", step=0)
    with pytest.raises(deepreduce.CommunicationError, match=r"rank 1: container holds a tensor of shape \(80, 100\), "
                                                            r"expected \(8000,\)"):
        tf_pipe.decode_sum(np.concatenate([payload, reshaped]), count=2)
    other = deepreduce.build(config("raw", value="raw", memory="none", ratio=0.5)).encode(g, name="w")
    raw = container.unpack(other)
    raw.index_section = raw.index_section[:4] * (len(raw.index_section) // 4)   # one index repeated
    with pytest.raises(deepreduce.ContainerError, match="repeats an index"):
        tf_pipe.decode(container.pack(raw))
    qsgd = deepreduce.build(os.path.join(ROOT, "configs", "qsgd.yaml")).encode(g, name="w")
    with pytest.raises(deepreduce.ContainerError, match="no TensorFlow op"):
        tf_pipe.decode(qsgd)


def test_encode_errors_keep_their_class():
    tf_pipe = drtf.build(config("raw", value="fp16", memory="none"), backend="tf-ops")
    g = np.ones(5000, np.float32)
    g[3] = 1e6
    with pytest.raises(deepreduce.DeepReduceError, match="beyond float16"):
        tf_pipe.encode(g, name="big", step=0)
    with pytest.raises(deepreduce.CommunicationError, match="keep its size"):
        pipe = drtf.build(config("raw"), backend="tf-ops")
        pipe.encode(np.ones(5000, np.float32), name="x")
        pipe.encode(np.ones(6000, np.float32), name="x")
    # nonfinite: raise lets the ranks decide each step together through the core's journal
    strict = config("raw", nonfinite="raise")
    assert "nonfinite" in ops.unsupported(deepreduce.build(strict))
    assert drtf.build(strict).backend == "numpy_function"


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_PROPERTY_PIPES = {}


def _property_pipe(policy, value, memory, sparsifier):
    key = (policy, value, memory, sparsifier)
    if key not in _PROPERTY_PIPES:
        cfg = config("bloom" if policy else "raw", policy or "p0", value, memory, ratio=0.03, min_numel=100)
        if sparsifier == "threshold":   # empty selections at the small scales
            cfg["sparsifier"] = {"id": "threshold", "threshold": 1e-3}
        tf_pipe = drtf.build(cfg, backend="tf-ops")
        # one tensor name per size (a residual keeps its size); the name is a Python string
        encode = tf.function(lambda x, s, name: tf_pipe.encode(x, name=name, step=s), reduce_retracing=True)
        decode = tf.function(lambda b: tf_pipe.decode(b), input_signature=[tf.TensorSpec([None], tf.uint8)])
        _PROPERTY_PIPES[key] = (deepreduce.build(cfg), encode, decode)
    return _PROPERTY_PIPES[key]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from((None,) + bloom_codec.POLICIES), value=st.sampled_from(VALUES),
       memory=st.sampled_from(["none", "residual"]), sparsifier=st.sampled_from(["topk", "threshold"]),
       size=st.integers(1, 20000), seed=st.integers(0, 2**32 - 1),
       step=st.integers(0, 2**40), scale=st.sampled_from([1e-40, 1e-30, 1e-3, 1.0]))
def test_property_ops_write_and_read_the_cores_bytes(policy, value, memory, sparsifier, size, seed, step, scale):
    core, encode, decode = _property_pipe(policy, value, memory, sparsifier)
    g = (np.random.default_rng(seed).standard_normal(size) * scale).astype(np.float32)
    payload = encode(tf.constant(g), tf.constant(step, tf.int64), name=f"p{size}").numpy()
    expected = core.encode(g, name=f"p{size}", step=step)
    assert np.array_equal(payload, expected)
    np.testing.assert_array_equal(decode(tf.constant(payload)).numpy(), core.decode(expected))


@pytest.mark.parametrize("path", OPS_FILE_CONFIGS, ids=config_id)
def test_property_hostile_containers_decode_as_in_the_core(path):
    """The hostile-input mutations (tests/hostile.py): on containers of the ops' codecs the decode
    op gives the core's tensor or the core's error class and text; on others a DeepReduceError.
    (The polyfit.yaml case also reaches permutations: its index section is reordered.)"""
    from test_hostile_containers import NUMEL, case, mutations

    core, base = case(path)
    tf_pipe = drtf.build(core, backend="tf-ops")

    def outcome(call):
        try:
            return "ok", np.asarray(call())
        except deepreduce.DeepReduceError as exc:
            return type(exc).__name__, str(exc)

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(payload=mutations(base))
    def check(payload):
        buf = np.frombuffer(payload, dtype=np.uint8)
        try:
            header = container.unpack(buf, max_numel=1 << 128)
            ours = header.dense or (header.index_id in (0, 1, 6) and header.value_id in (0, 1, 2))
        except deepreduce.DeepReduceError:
            ours = True   # a header the core refuses: the op refuses it with the same text
        for calls in (((lambda: tf_pipe.decode(buf)), (lambda: core.decode(buf))),
                      ((lambda: tf_pipe.decode(buf, (NUMEL,))), (lambda: core.decode(buf, (NUMEL,)))),
                      ((lambda: tf_pipe.decode_sum(np.concatenate([buf, buf]), (NUMEL,), count=2)),
                       (lambda: core.decode_sum([buf, buf], (NUMEL,))))):
            got, expected = outcome(calls[0]), outcome(calls[1])
            if not ours:
                assert got[0] != "ok"
            elif got[0] == "ok" or expected[0] == "ok":
                assert got[0] == expected[0] == "ok" and np.array_equal(got[1], expected[1], equal_nan=True)
            else:
                assert got == expected

    check()
