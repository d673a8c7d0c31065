"""Issue 13 regressions: every hostile example of the issue, one test each.

Decode is bounded by the expected shape (or ``max_numel``) and by the bytes; only DeepReduceError
comes out of decode / inspect / load_config / build; a container without the non-finite flag
never decodes to NaN/Inf; tensors of every binding are checked alike. Claims that would allocate
or scan terabytes run in a child process under an address-space limit and a timeout, so a
regression fails the test instead of the machine.
"""
import os

import numpy as np
import pytest
from hostile import CONFIGS, NUMEL, ROOT, gradient, pack_v1, rewrite, run_bounded, valid_container
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deepreduce
from deepreduce import registry
from deepreduce.errors import CommunicationError, ConfigError, ContainerError, DeepReduceError, NonFiniteGradientError
from deepreduce.wire import container

TOPK_RAW = os.path.join(ROOT, "configs", "topk_raw.yaml")
BF_P2 = os.path.join(ROOT, "configs", "bf_p2.yaml")
HUFFMAN = os.path.join(ROOT, "configs", "huffman.yaml")


# ------------------------------------------------------------------ 1. bounded decode
def test_shape_of_2_pow_40_is_refused_without_allocating():
    out = run_bounded(f"""
        import warnings; warnings.simplefilter("ignore")
        import deepreduce
        from hostile import rewrite, valid_container
        pipe, payload = valid_container({TOPK_RAW!r})
        bad = rewrite(payload, shape=(2**40,))
        for call in (lambda: pipe.decode(bad), lambda: pipe.decode_sum([bad]), lambda: deepreduce.inspect(bad)):
            try:
                call()
            except deepreduce.ContainerError as exc:
                print("refused:", exc)
    """)
    assert out.count("refused:") == 3 and "max_numel = 268435456" in out


def test_expected_shape_is_checked_before_anything_else():
    pipe, payload = valid_container(TOPK_RAW)
    bad = rewrite(payload, shape=(2**40,))
    with pytest.raises(CommunicationError, match=r"shape \(1099511627776,\), expected \(3000,\)"):
        pipe.decode(bad, expected_shape=(NUMEL,))
    with pytest.raises(CommunicationError, match="rank 0"):
        pipe.decode_sum([bad], expected_shape=(NUMEL,))
    with pytest.raises(CommunicationError):
        deepreduce.inspect(bad, expected_shape=(NUMEL,))
    # with the expected shape, a tensor beyond max_numel is fine: the receiver allocates it anyway
    big = deepreduce.build(TOPK_RAW)
    big.max_numel = 10
    np.testing.assert_array_equal(big.decode(payload, expected_shape=(NUMEL,)), pipe.decode(payload))


def test_max_numel_is_configurable_and_documented_in_the_message():
    config = deepreduce.load_config(TOPK_RAW)
    assert config["max_numel"] == container.MAX_NUMEL
    small = deepreduce.build({**config, "max_numel": 100})
    _, payload = valid_container(TOPK_RAW)
    with pytest.raises(ContainerError, match="above max_numel = 100; pass the expected shape or raise max_numel"):
        small.decode(payload)
    # a receiver setting: it never changes a byte, nor the config digest
    assert small.config_digest == deepreduce.build(TOPK_RAW).config_digest


def test_bloom_shape_raised_to_2_pow_40_does_not_scan_it():
    out = run_bounded(f"""
        import warnings; warnings.simplefilter("ignore")
        import deepreduce
        from hostile import rewrite, valid_container
        pipe, payload = valid_container({BF_P2!r})
        try:
            pipe.decode(rewrite(payload, shape=(2**40,)))
        except deepreduce.ContainerError as exc:
            print("refused:", exc)
    """, timeout=60)
    assert "refused:" in out


def test_huffman_count_of_2_pow_30_is_refused_before_allocating():
    # the receiver's bound is lifted (max_numel 2**32): the codec's own count-vs-bytes check must hold
    out = run_bounded(f"""
        import struct, warnings; warnings.simplefilter("ignore")
        import deepreduce
        from hostile import rewrite, valid_container
        pipe, payload = valid_container({HUFFMAN!r})
        pipe.max_numel = 2**32
        bad = rewrite(payload, n=2**30, shape=(2**31,), index_params=struct.pack("<Q", 2**31))
        try:
            pipe._codec("index", 3).decode(struct.pack("<Q", 2**31), deepreduce.wire.container.unpack(bad, max_numel=2**32).index_section, 2**30, 2**31)
        except deepreduce.ContainerError as exc:
            print("refused:", exc)
    """)
    assert "refused:" in out and "cannot hold 4294967296 symbols" in out


def test_qsgd_bucket_size_does_not_drive_allocation():
    """Found by the fuzzer: a bucket size of 2**32 - 1 expanded one norm to 2**32 entries."""
    out = run_bounded(f"""
        import struct, warnings; warnings.simplefilter("ignore")
        import numpy as np
        import deepreduce
        from deepreduce import registry
        qsgd = registry.get_class("value", "qsgd")
        payload = np.float32(2.0).tobytes() + np.array([1, -1, 0], np.int8).tobytes()
        print("decoded:", qsgd().decode(struct.pack("<HI", 127, 2**32 - 1), payload, 3).tolist())
        pipe = deepreduce.build({{**deepreduce.load_config({TOPK_RAW!r}), "min_numel": 0,
                                 "value": {{"id": "qsgd", "bucket_size": 2**32 - 1}}}})
        print("round trip:", pipe.decode(pipe.encode(np.ones(10, np.float32), name="w")).shape)
    """)
    assert "decoded: [0.015748031437397003, -0.015748031437397003, 0.0]" in out and "round trip: (10,)" in out


def test_shape_of_two_2_pow_64_dimensions_is_a_container_error():
    pipe, payload = valid_container(TOPK_RAW)
    with pytest.raises(ContainerError, match="above max_numel"):
        pipe.decode(rewrite(payload, shape=(2**64 - 1, 2**64 - 1)))


def test_bloom_count_reaching_2_pow_64_is_a_container_error():
    pipe, payload = valid_container(BF_P2)
    with pytest.raises(ContainerError, match="claims 18446744073709551615 values for a tensor of 3000"):
        pipe.decode(rewrite(payload, n=2**64 - 1))


def test_v1_containers_get_the_same_bounds():
    pipe, payload = valid_container(TOPK_RAW)
    c = container.unpack(payload)
    c.shape = (2**40,)
    with pytest.raises(ContainerError, match="above max_numel"):
        pipe.decode(np.frombuffer(pack_v1(c), np.uint8))
    c.shape, c.n = (NUMEL,), 2**63
    with pytest.raises(ContainerError, match="claims 9223372036854775808 values"):
        pipe.decode(np.frombuffer(pack_v1(c), np.uint8))


@pytest.mark.parametrize("kind, codec, params, section, count, message", [
    ("value", "deflate", b"", b"x\x9c\x03\x00\x00\x00\x00\x01", 10**6, "cannot inflate"),
    ("value", "sketchml", b"\x03\x02\x01\x00\x00\x00\x00\x00", b"\x00" * 5, 10**6, "cannot hold"),
    ("value", "polyfit", b"\x05\x04", b"\x00\x00\x00\x00", 10**9, "segment"),
    ("index", "delta_huffman", b"\x01", (10**6).to_bytes(4, "little"), 10**6, "does not hold"),
])
def test_codec_counts_need_their_minimum_bytes(kind, codec, params, section, count, message):
    """A header count the section cannot back is refused before ``count`` entries are allocated."""
    decoder = registry.get_class(kind, codec)()
    args = (params, section, count) if kind == "value" else (params, section, count, 10 * count)
    with pytest.raises(ContainerError, match=message):
        decoder.decode(*args)


# ------------------------------------------------------------------ 3. finite in, finite out
@pytest.mark.parametrize("config, codec", [("topk_raw", "raw"), ("topk_raw", "fp16")])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_values_decoding_to_nonfinite_without_the_flag_are_refused(config, codec, bad):
    pipe = deepreduce.build({**deepreduce.load_config(os.path.join(ROOT, "configs", f"{config}.yaml")),
                             "value": {"id": codec}, "min_numel": 0})
    c = container.unpack(pipe.encode(gradient(), name="w"))
    dtype = "<f4" if codec == "raw" else "<f2"
    values = np.frombuffer(c.value_section, dtype).copy()
    values[-1] = bad
    c.value_section = values.tobytes()
    for payload in (container.pack(c), np.frombuffer(pack_v1(c), np.uint8)):
        with pytest.raises(ContainerError, match="NaN/Inf but its header does not carry the non-finite flag"):
            pipe.decode(payload)


def test_dense_sections_follow_the_flag():
    pipe = deepreduce.build(TOPK_RAW)
    grad = gradient(10)
    c = container.unpack(pipe.encode(grad, name="small"))
    assert c.dense and not c.nonfinite
    values = grad.copy()
    values[3] = np.nan
    with pytest.raises(ContainerError, match="dense section"):
        pipe.decode(rewrite(container.pack(c), value_section=values.tobytes()))
    flagged = rewrite(container.pack(c), value_section=values.tobytes(),
                      flags=container.FLAG_DENSE | container.FLAG_NONFINITE)
    assert np.isnan(pipe.decode(flagged)[3])   # propagated, as the sender said


@pytest.mark.parametrize("nonfinite", ["propagate", "raise"])
def test_decode_sum_overflow_follows_the_nonfinite_policy(nonfinite):
    """Found by the fuzzer: two finite containers whose sum overflows float32."""
    pipe = deepreduce.build({**deepreduce.load_config(TOPK_RAW), "nonfinite": nonfinite, "min_numel": 0})
    grad = np.zeros(NUMEL, np.float32)
    grad[:30] = 3e38
    payload = pipe.encode(grad, name="w")
    if nonfinite == "raise":
        with pytest.raises(NonFiniteGradientError, match="overflow when added"):
            pipe.decode_sum([payload, payload], expected_shape=(NUMEL,))
    else:   # Inf, as a float32 allreduce gives (an AMP loss scaler then skips the step)
        assert np.isinf(pipe.decode_sum([payload, payload], expected_shape=(NUMEL,))[:30]).all()


# ------------------------------------------------------------------ 2. configs: only ConfigError
def _write(tmp_path, text, name="c.yaml", raw=False):
    path = tmp_path / name
    path.write_bytes(text if raw else text.encode())
    return str(path)


BASE = "sparsifier: {id: topk, ratio: 0.01}\nvalue: raw\nmemory: residual\n"


@pytest.mark.parametrize("text, message", [
    (BASE + "index:\n", "section 'index' is empty"),
    (BASE + "index: {id: [raw]}\n", "'id' must be a string, got \\['raw'\\]"),
    (BASE + "index: {id: {raw: 1}}\n", "'id' must be a string, got \\{'raw': 1\\}"),
    (BASE + "index: {id: raw, 1: 2}\n", "parameter names must be strings, got 1"),
    (BASE + "index: raw\nindex: bloom\n", "duplicate key 'index'"),
    (BASE + "index: {id: bloom, fpr: 1.0e-300}\n", r"'fpr' is 1e-300; allowed: a float in \[1e-12, 1.0\)"),
    (BASE + "index: raw\nmin_numel: 1000000000000000000000000000000\n", r"'min_numel' must be an integer in \[0, 2\*\*60\]"),
    (BASE + "index: raw\nmax_numel: 0\n", r"'max_numel' must be an integer in \[1, 2\*\*60\]"),
    (BASE + "index: raw\nthreads: 100000\n", r"'threads' must be an integer in \[1, 256\]"),
    (BASE + "index: raw\nnonfinite: [raise]\n", "'nonfinite' is \\['raise'\\]"),
    (BASE + "index: raw\n3: 4\n", "unknown key 3"),
    ("sparsifier: {id: threshold, threshold: 1.0e+300}\nindex: raw\nvalue: raw\nmemory: residual\n",
     r"'threshold' is 1e\+300; allowed: a float in \(0.0, 3.4028234663852886e\+38\]"),
    ("sparsifier: {id: topk, ratio: 0.01}\nindex: raw\nvalue: {id: polyfit, min_points: 1.0e+30}\nmemory: residual\n",
     r"'min_points' is 1000000000000000019884624838656; allowed: an? int in \[1, 2147483647\]"),
    ("- just\n- a list\n", "must hold a mapping"),
    ("a: &x [*x]\n", "holds itself"),
])
def test_bad_configs_raise_config_error_naming_the_problem(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=message):
        deepreduce.load_config(path)
    with pytest.raises(ConfigError, match=message):
        deepreduce.build(path)


JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6) | st.integers(), inner, max_size=3),
    max_leaves=6)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(path=st.sampled_from(CONFIGS), data=st.data())
def test_mutated_config_dicts_build_or_raise_config_error(path, data):
    """Any value at any key of a valid config: a pipeline or a ConfigError, nothing else."""
    config = deepreduce.load_config(path)
    section = data.draw(st.sampled_from(sorted(config) + ["extra"]))
    where = data.draw(st.sampled_from(["whole", "param", "key"]))
    if where == "whole" or not isinstance(config.get(section), dict):
        config[section] = data.draw(JUNK)
    elif where == "param":
        config[section][data.draw(st.sampled_from(sorted(config[section])))] = data.draw(JUNK)
    else:
        config[section][data.draw(st.text(max_size=6) | st.integers())] = data.draw(JUNK)
    try:
        deepreduce.build(config)
    except ConfigError:
        pass


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(text=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_arbitrary_config_files_raise_only_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_bytes(text)
    try:
        deepreduce.build(str(path))
    except ConfigError:
        pass


def test_non_utf8_config_file_is_a_config_error(tmp_path):
    path = _write(tmp_path, b"index: \xff\xfe raw\n", raw=True)
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        deepreduce.load_config(path)


def test_config_dicts_get_the_same_checks():
    config = deepreduce.load_config(TOPK_RAW)
    for bad in ({**config, "index": None}, {**config, "index": {"id": ["raw"]}},
                {**config, "index": {"id": "raw", ("tuple",): 1}}, {**config, 7: 1}):
        with pytest.raises(ConfigError):
            deepreduce.build(bad)


# ------------------------------------------------------------------ 6. tensors
def test_zero_dim_tensors_round_trip_as_zero_dim():
    torch = pytest.importorskip("torch")
    from deepreduce.torch import pipeline as torch_pipeline

    pipe = torch_pipeline.build(TOPK_RAW)
    out = pipe.decode(pipe.encode(torch.tensor(2.5), name="scale"), expected_shape=())
    assert out.shape == torch.Size([]) and float(out) == 2.5
    core = deepreduce.build(TOPK_RAW)
    assert core.decode(core.encode(np.float32(2.5), name="scale")).shape == ()


def test_integer_gradients_are_refused_alike_in_every_binding():
    torch = pytest.importorskip("torch")
    from deepreduce.torch import pipeline as torch_pipeline

    expected = "gradient 'w' has dtype int64; deepreduce compresses floating-point tensors"
    with pytest.raises(DeepReduceError, match=expected):
        deepreduce.build(TOPK_RAW).encode(np.arange(10), name="w")
    with pytest.raises(DeepReduceError, match=expected):
        torch_pipeline.build(TOPK_RAW).encode(torch.arange(10), name="w")


@pytest.mark.parametrize("nonfinite", ["propagate", "raise"])
def test_float64_beyond_float32_range_is_reported_as_overflow(nonfinite):
    pipe = deepreduce.build({**deepreduce.load_config(TOPK_RAW), "nonfinite": nonfinite})
    grad = np.ones(2000)
    grad[[5, 7]] = 1e300
    with pytest.raises(NonFiniteGradientError, match=r"has 2 finite values beyond float32's range .*overflow") as info:
        pipe.encode(grad, name="w")
    assert "Inf entries" not in str(info.value)


def test_torch_float64_overflow_and_sparse_tensors():
    torch = pytest.importorskip("torch")
    from deepreduce.torch import pipeline as torch_pipeline

    pipe = torch_pipeline.build(TOPK_RAW)
    big = torch.ones(2000, dtype=torch.float64)
    big[0] = 1e300
    with pytest.raises(NonFiniteGradientError, match="overflow"):
        pipe.encode(big, name="w")
    # an uncoalesced COO tensor (index 2 twice) encodes as its coalesced dense form
    sparse = torch.sparse_coo_tensor([[0, 2, 2, 1999]], [1.0, 2.0, 3.0, 4.0], (2000,))
    dense = torch.zeros(2000)
    dense[0], dense[2], dense[1999] = 1.0, 5.0, 4.0
    other = torch_pipeline.build(TOPK_RAW)
    assert torch.equal(pipe.encode(sparse, name="e"), other.encode(dense, name="e"))


def test_tensorflow_binding_refuses_integers_and_reports_overflow():
    tf = pytest.importorskip("tensorflow")
    from deepreduce.tensorflow import pipeline as tf_pipeline

    pipe = tf_pipeline.TFPipeline(deepreduce.build(TOPK_RAW))
    with pytest.raises(DeepReduceError, match="gradient 'w' has dtype int64; deepreduce compresses floating-point"):
        pipe.encode(tf.range(10, dtype=tf.int64), name="w")
    with pytest.raises(NonFiniteGradientError, match="overflow"):
        pipe.encode(tf.constant([1.0, 1e300], dtype=tf.float64), name="w")


def test_tensorflow_decode_op_has_the_same_bounds_and_finiteness_check():
    tf = pytest.importorskip("tensorflow")
    from deepreduce.tensorflow import ops
    from deepreduce.tensorflow import pipeline as tf_pipeline

    try:
        ops.load()
    except deepreduce.BackendUnavailableError as exc:
        pytest.skip(f"TensorFlow custom ops are not built: {exc}")
    core = deepreduce.build({**deepreduce.load_config(TOPK_RAW), "min_numel": 0})
    pipe = tf_pipeline.TFPipeline(core, backend="tf-ops")
    assert pipe.backend == "tf-ops"
    payload = container.unpack(core.encode(gradient(), name="w"))
    big = rewrite(container.pack(payload), shape=(2**40,))
    with pytest.raises(ContainerError, match="above max_numel = 268435456"):
        pipe.decode(tf.constant(big))
    with pytest.raises(CommunicationError, match="expected"):
        pipe.decode(tf.constant(big), expected_shape=(NUMEL,))
    values = np.frombuffer(payload.value_section, "<f4").copy()
    values[0] = np.nan
    nan = rewrite(container.pack(payload), value_section=values.tobytes())
    with pytest.raises(ContainerError, match="NaN/Inf but its header does not carry the non-finite flag"):
        pipe.decode(tf.constant(nan), expected_shape=(NUMEL,))
