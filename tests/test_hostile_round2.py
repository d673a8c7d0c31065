"""Issue 26 regressions (items 1, 2, 5 and 7): one test per item and hostile example.

Hostile containers are generated deterministically (tests/hostile.py), written to a file and
decoded in a child process under a 3 GiB address-space limit and a timeout through every
binding present: the NumPy core, the torch host path, the torch device path (CPU tensors) and
the TensorFlow decode op. A crash, an abort or a foreign exception fails the child and the test.
"""

import hostile
import numpy as np
import pytest
from hostile import bloom_container, run_bounded, zero_element_container

import deepreduce
from deepreduce.backend import _native
from deepreduce.errors import ConfigError, ContainerError, quote
from deepreduce.index import bloom

BIG = 1 << 24            # the issue's legitimate (2**24,) layer
MID = 1 << 20            # the accepted worst cases, kept small enough for a loaded test machine
NATIVE = _native.load("bloom")


def decode_everywhere(tmp_path, data: bytes, shapes, timeout: float = 300.0, bindings=hostile.BINDINGS,
                      env: dict = None) -> list:
    """``binding shape: outcome`` lines of every present binding of ``bindings``, from a capped
    child process (with extra environment variables ``env``)."""
    path = tmp_path / "container.bin"
    path.write_bytes(data)
    out = run_bounded(f"import hostile; hostile.decode_everywhere({str(path)!r}, {shapes!r}, {bindings!r})",
                      timeout=timeout, env=env)
    lines = [line for line in out.splitlines() if not line.endswith(": absent")]
    assert {line.split()[0] for line in lines} >= {"numpy", "torch-host"} & set(bindings), out
    assert len(lines) == len(shapes) * len({line.split()[0] for line in lines}), out
    return lines


# ------------------------------------------------------------------ item 1: 0-element shapes
@pytest.mark.parametrize("shape", [(0, 2**63), (0, 2**62, 4), (2**40, 0, 2**40)])
def test_zero_element_tensor_with_huge_dimension_is_a_container_error_everywhere(tmp_path, shape):
    lines = decode_everywhere(tmp_path, zero_element_container(shape), [None])
    for line in lines:
        assert "ContainerError: " in line and "container claims a 0-element tensor" in line, line


def test_zero_element_tensor_within_max_numel_still_decodes(tmp_path):
    lines = decode_everywhere(tmp_path, zero_element_container((0, 1000)), [None, (0, 1000)])
    assert all(line.endswith("decoded (0, 1000)") for line in lines), lines


def test_max_numel_is_capped_where_frameworks_stop():
    with pytest.raises(ConfigError, match=r"\[1, 2\*\*60\]"):
        deepreduce.build({**deepreduce.load_config("topk_raw"), "max_numel": 2**61})


# ------------------------------------------------------------------ item 2: Bloom decode work
@pytest.mark.parametrize("policy,k,blocks,n,message", [
    ("p2", 9, 1, 8, "512 bits set; 8 keys of k = 9 hashes set at most 72"),       # the issue's 148 bytes
    ("p1", 9, 1, 8, "bits set"),
    ("middle", 9, 1, 8, "bits set"),
    ("naive", 9, 1, 8, "bits set"),
    ("p0", 9, 1, 8, "bits set"),
    ("p2", 3, 1, 171, "k * rate above 2"),
    ("p2", 2, 1, 1024, "k * r above twice the bits"),
    ("p2", 1, 1, 64 * 512 + 1, "more than 64 keys per set bit"),
])
def test_bloom_filter_beyond_its_claim_is_refused_everywhere(tmp_path, policy, k, blocks, n, message):
    lines = decode_everywhere(tmp_path, bloom_container(policy, k, blocks, n, BIG), [None, (BIG,)])
    for line in lines:
        assert "ContainerError" in line and message in line, line


@pytest.mark.parametrize("k,n", [(1, 64 * 512), (2, 512)])
def test_accepted_worst_case_p2_filter_decodes_within_the_bound(tmp_path, k, n):
    """The fullest all-ones P2 filters the checks let through decode, under the memory cap."""
    lines = decode_everywhere(tmp_path, bloom_container("p2", k, 1, n, MID), [(MID,)], timeout=600)
    assert all(line.endswith(f"decoded ({MID},)") for line in lines), lines


# The issue's layer with the fullest all-ones P2 filter the checks admit for k = 1: every one of
# the 2**24 positions a positive, 512 conflict sets of 32768 members, r = 64 * 512, so Algorithm 1
# runs 64 passes over the 512 sets. Each visit used to rescan its set (passes x positives); with
# the per-set index of unchosen members it costs O(log 32768). The limit is about 10x what the
# slower child (four bindings) took on the project's 2-core machine under heavy load
# (docs/reliability.md): generous, so that a loaded machine does not flake it.
ISSUE_LAYER_LIMIT = 600


@pytest.mark.parametrize("backend", ["native", "numpy"])
def test_all_ones_p2_filter_of_the_issue_layer_decodes_within_the_limit(tmp_path, backend):
    """In every binding with the C++ kernels (NumPy core, torch host and device paths, TF op), and
    through the NumPy core without them, in a child under the 3 GiB cap."""
    env, bindings = ({}, hostile.BINDINGS) if backend == "native" else ({"DEEPREDUCE_BACKEND": "numpy"}, ("numpy",))
    lines = decode_everywhere(tmp_path, bloom_container("p2", 1, 1, 64 * 512, BIG), [(BIG,)],
                              timeout=ISSUE_LAYER_LIMIT, bindings=bindings, env=env)
    assert all(line.endswith(f"decoded ({BIG},)") for line in lines), lines


def _honest_filter(d: int, r: int, fpr: float, seed: int = 3):
    rng = np.random.default_rng(seed)
    keys = np.sort(rng.choice(d, r, replace=False)).astype(np.uint64)
    blocks, k = bloom.filter_params(r, fpr)
    bits = bloom.np_build(keys, blocks, k, 11)
    return bits, blocks, k


@pytest.mark.parametrize("fpr", [1e-12, 1e-6, 1e-3, 0.1, 0.38, 0.6, 0.99, 1 - 2**-52])
@pytest.mark.parametrize("ratio", [0.0, 1e-3, 0.5, 1.0])
def test_honest_filters_pass_at_extreme_rates_and_ratios(fpr, ratio):
    """Every honest filter passes every check, its positives lie within the limit, and the C++
    and NumPy/torch twins agree on the limit."""
    d = 1 << 16
    r = max(1, int(d * ratio))
    bits, blocks, k = _honest_filter(d, r, fpr)
    P = bloom.np_query(bits, blocks, k, 11, d, d)
    limit = bloom.positive_limit(bits, blocks, k, r, d, "blocked", conflict=True)
    assert r <= P.size <= limit
    if NATIVE is not None:
        assert NATIVE.positive_limit(bits, blocks, k, r, d, "blocked", True) == limit
    torch = pytest.importorskip("torch")
    section = torch.frombuffer(bytearray(bits), dtype=torch.uint8)
    assert bloom.positive_limit(section, blocks, k, r, d, "blocked", True, section) == limit


@pytest.mark.parametrize("config", ["bf_p2", "bf_p1", "bf_p0", "bf_naive", "bfp2_polyfit"])
@pytest.mark.parametrize("numel,ratio,fpr", [(1 << 22, 1e-6, 1e-3), (1 << 16, 0.5, 0.99),
                                              (1 << 16, 0.9, 1e-12), (3, 1.0, 0.5)])
def test_honest_bloom_containers_decode_at_extreme_sizes(config, numel, ratio, fpr):
    cfg = deepreduce.load_config(config)
    cfg["sparsifier"] = {"id": "topk", "ratio": ratio}
    cfg["index"]["fpr"] = fpr
    cfg["min_numel"] = 0
    pipe = deepreduce.build(cfg)
    grad = np.random.default_rng(5).standard_normal(numel).astype(np.float32)
    payload = pipe.encode(grad, name="w", step=1)
    out = pipe.decode(payload, expected_shape=(numel,))
    assert out.shape == (numel,) and np.count_nonzero(out) >= 1


def test_more_positives_than_the_rate_allows_is_refused():
    """The positive bound itself (hard to meet with a real filter: a pseudo-random hash gives
    every filter about rate * d positives): more than the limit is a ContainerError."""
    with pytest.raises(ContainerError, match="more than 100 positives"):
        bloom.check_positives("p1", 101, 10, 100)
    bloom.check_positives("p1", 100, 10, 100)


@pytest.mark.skipif(NATIVE is None, reason="C++ Bloom kernels not built")
def test_positive_limit_twins_agree_on_hostile_filters():
    rng = np.random.default_rng(9)
    for _ in range(200):
        blocks, k = int(rng.integers(1, 8)), int(rng.integers(1, 12))
        density = np.uint8(rng.choice([0x00, 0x01, 0x0F, 0x7F, 0xFF]))
        bits = (rng.integers(0, 256, 64 * blocks, dtype=np.uint8) & density).tobytes()
        r, d = int(rng.integers(0, 5000)), int(rng.integers(1, 1 << 20))
        for conflict in (False, True):
            try:
                expected = NATIVE.positive_limit(bits, blocks, k, r, d, "blocked", conflict)
            except ValueError as exc:
                with pytest.raises(ValueError) as twin:
                    bloom.positive_limit(bits, blocks, k, r, d, "blocked", conflict)
                assert str(twin.value) == str(exc)
            else:
                assert bloom.positive_limit(bits, blocks, k, r, d, "blocked", conflict) == expected


# ------------------------------------------------------------------ item 5: configs
def _alias_bomb(levels: int = 9) -> str:
    parts = ["&a0 [lol,lol,lol,lol,lol,lol,lol,lol,lol]"]
    parts += [f"&a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return ("sparsifier: {id: topk, ratio: 0.01}\nindex: {id: bloom, fpr: [" + ", ".join(parts) + "]}\n"
            "value: {id: raw}\nmemory: {id: none}\n")


def test_yaml_alias_bomb_fails_fast_with_a_config_error(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb())
    assert len(path.read_bytes()) < 500
    out = run_bounded(f"""
        import deepreduce
        try:
            deepreduce.load_config({str(path)!r})
        except deepreduce.ConfigError as exc:
            print("refused:", exc)
    """, timeout=30)
    assert "refused:" in out and "expands to more than 10000 items" in out


@pytest.mark.parametrize("text,message", [
    ("a: &x [*x]\n", "holds itself"),
    ("index: " + "[" * 40 + "]" * 40 + "\n", "nests deeper than 16"),
])
def test_recursive_and_deep_configs_are_refused(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        deepreduce.load_config(str(path))


def test_oversized_config_file_is_refused_before_parsing(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# " + "x" * (70 << 10) + "\n")
    with pytest.raises(ConfigError, match="larger than 65536 bytes"):
        deepreduce.load_config(str(path))


def test_error_messages_quote_a_short_prefix_of_a_value():
    config = deepreduce.load_config("bf_p2")
    for value in ("y" * 100_000, list(range(100_000)), [[[[[1]]]]] * 1000):
        config["index"]["fpr"] = value
        with pytest.raises(ConfigError) as exc:
            deepreduce.build(config)
        assert len(str(exc.value)) < 200, str(exc.value)
    assert len(quote("z" * 10**6)) == 60


# ------------------------------------------------------------------ item 7: smaller ones
def test_scatter_add_unchecked_refuses_out_of_range_indices():
    select = _native.load("select")
    if select is None:
        pytest.skip("C++ select kernels not built")
    out = np.zeros(4, dtype=np.float32)
    for bad in ([4], [-1], [0, 2**40]):
        idx = np.array(bad, dtype=np.int64)
        with pytest.raises(ValueError, match="outside"):
            select.scatter_add_unchecked(out, idx, np.ones(idx.size, np.float32), 1)
    assert not out.any()
    select.scatter_add_unchecked(out, np.array([3, 0], dtype=np.int64), np.ones(2, np.float32), 1)
    assert out.tolist() == [1, 0, 0, 1]


@pytest.mark.parametrize("shape", [(0,), (3, 0)])
def test_torch_device_path_encodes_and_decodes_empty_tensors(shape):
    torch = pytest.importorskip("torch")
    from deepreduce.torch.pipeline import TorchPipeline

    for config in ("topk_raw", "bf_p2", "qsgd"):
        pipe = deepreduce.build(config)
        pipe.min_numel = 0
        tp = TorchPipeline(pipe, path="device")
        payload = tp.encode(torch.zeros(shape), name="w", step=1)
        assert tuple(tp.decode(payload, device="cpu").shape) == shape
        assert tuple(tp.decode_sum([payload, payload], expected_shape=shape, device="cpu").shape) == shape


@pytest.mark.parametrize("config", ["topk_raw", "rle", "sketchml"])
def test_tensorflow_decodes_a_0d_tensor_as_shape_empty(config):
    tf = pytest.importorskip("tensorflow")
    from deepreduce.tensorflow import pipeline as tfp

    for backend in ("auto", "numpy_function"):
        pipe = tfp.build(config, backend=backend)
        payload = pipe.encode(tf.constant(2.5), name="w", step=1)
        assert tuple(pipe.decode(payload).shape) == ()
        assert tuple(pipe.decode(payload, expected_shape=()).shape) == ()
        assert tuple(pipe.decode_sum(tf.concat([payload, payload], 0), expected_shape=()).shape) == ()

        @tf.function
        def graph(p):
            return pipe.decode(p, expected_shape=())

        assert tuple(graph(payload).shape) == ()
