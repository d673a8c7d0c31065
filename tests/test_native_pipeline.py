"""The C++ pipeline subset (csrc/pipeline, bound as deepreduce._pipeline, the code the TensorFlow ops
run) writes the core pipeline's bytes, keeps its residuals and refuses what it refuses with its
texts, for every config whose stages exist in C++ -- checked here without TensorFlow."""
import glob
import os
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deepreduce
from deepreduce.backend import native_pipeline
from deepreduce.collective.shards import encode_shards
from deepreduce.index import bloom as bloom_codec
from deepreduce.wire import container

_pipeline = pytest.importorskip("deepreduce._pipeline", reason="needs the C++ extensions (make setup)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (64, 64, 3, 3)


def config(index="raw", policy="p0", value="raw", memory="residual", **extra):
    idx = {"id": "bloom", "policy": policy, "fpr": 0.01} if index == "bloom" else {"id": index}
    return {"sparsifier": {"id": "topk", "ratio": 0.02}, "index": idx, "value": {"id": value},
            "memory": {"id": memory}, **extra}


FILE_CONFIGS = [c for c in sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
                if deepreduce.build(c).native_reason() is None]
CONFIGS = FILE_CONFIGS + [config("bloom", p, v, m) for p in bloom_codec.POLICIES for v in ("raw", "fp16", "polyfit")
                          for m in ("none", "residual")] \
    + [config(i, value=v) for i in ("raw", "elias_fano") for v in ("raw", "fp16", "polyfit")] \
    + [dict(config(i, "p1", v), sparsifier={"id": "threshold", "threshold": 0.02})
       for i in ("raw", "bloom") for v in ("raw", "polyfit")]


def config_id(c):
    if isinstance(c, str):
        return os.path.basename(c)
    return f"{c['sparsifier']['id']}-{c['index'].get('policy', c['index']['id'])}-{c['value']['id']}-{c['memory']['id']}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
def test_cpp_pipeline_writes_and_reads_the_cores_bytes(cfg):
    core, peer = deepreduce.build(cfg), deepreduce.build(cfg)
    settings = core.native_settings
    residual = None
    rng = np.random.default_rng(5)
    for step in range(3):
        g = (rng.standard_normal(SHAPE) * 0.01).astype(np.float32)
        g[0, 0] = -0.0
        payload, residual = _pipeline.encode(settings, "conv", step, g, residual)
        expected = core.encode(g, name="conv", step=step)
        assert np.array_equal(payload, expected), f"step {step}"
        both = np.concatenate([expected, peer.encode(g[::-1].copy(), name="conv", step=step)])
        np.testing.assert_array_equal(_pipeline.decode_sum(both, count=2, shape=SHAPE, threads=core.threads),
                                      core.decode_sum(container.split(both), SHAPE))
    if core.memory.stateful:
        np.testing.assert_array_equal(residual, core.memory.residual("conv"))
    else:
        assert residual is None
    # non-finite gradients travel dense and leave the residual as the core leaves it
    bad = (rng.standard_normal(5000) * 0.01).astype(np.float32)
    bad[7] = np.nan
    held = None
    for step in range(2):
        payload, held = _pipeline.encode(settings, "nan", step, bad, held)
        assert np.array_equal(payload, core.encode(bad, name="nan", step=step))


def outcome(call):
    try:
        return call()
    except deepreduce.DeepReduceError as exc:
        return type(exc).__name__, str(exc)


def native_outcome(call):
    try:
        return call()
    except deepreduce.CommunicationError as exc:
        return "CommunicationError", str(exc)
    except ValueError as exc:
        return "ContainerError", str(exc)


@pytest.mark.parametrize("cfg", [config("bloom", "p2", "polyfit"), config("raw", value="fp16"), config("bloom", "p0"),
                                 config("elias_fano", value="polyfit")],
                         ids=config_id)
def test_cpp_pipeline_refuses_what_the_core_refuses(cfg):
    core = deepreduce.build(cfg)
    g = (np.random.default_rng(2).standard_normal(SHAPE) * 0.01).astype(np.float32)
    good = core.encode(g, name="conv", step=0)
    cases = [(good, SHAPE), (good, (64, 64, 9)), (good[:-1], SHAPE)]
    rng = np.random.default_rng(9)
    for _ in range(40):   # one corrupted byte, the checksum made right again
        buf = good.copy()
        buf[rng.integers(8, buf.size - 4)] ^= np.uint8(1 << rng.integers(0, 8))
        buf[-4:] = np.frombuffer(np.uint32(zlib.crc32(buf[:-4].tobytes())).tobytes(), np.uint8)
        cases.append((buf, SHAPE))
    for buf, shape in cases:
        expected = outcome(lambda: core.decode(buf, shape))
        got = native_outcome(lambda: _pipeline.decode_sum(buf, single=True, shape=shape))
        if isinstance(expected, tuple):
            assert got == expected
        else:
            np.testing.assert_array_equal(got, expected)


def test_settings_of_an_unsupported_config_are_not_asked_for():
    assert "qsgd" in deepreduce.build(os.path.join(ROOT, "configs", "qsgd.yaml")).native_reason()
    # the C++ pipeline has no warm-up: such a config runs through the core in every binding
    warm = dict(deepreduce.load_config(os.path.join(ROOT, "configs", "topk_raw.yaml")), warmup=3)
    assert "warmup" in deepreduce.build(warm).native_reason()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(numel=st.integers(1, 5000), ratio=st.floats(0.0005, 1.0), memory=st.sampled_from(("none", "residual")),
       value=st.sampled_from(("raw", "fp16", "polyfit")), seed=st.integers(0, 2 ** 16))
def test_cpp_elias_fano_is_the_cores_at_any_size_and_ratio(numel, ratio, memory, value, seed):
    cfg = dict(config("elias_fano", value=value, memory=memory), sparsifier={"id": "topk", "ratio": ratio},
               min_numel=0)
    core = deepreduce.build(cfg)
    rng = np.random.default_rng(seed)
    residual = None
    for step in range(2):
        g = (rng.standard_normal(numel) * 0.01).astype(np.float32)
        payload, residual = _pipeline.encode(core.native_settings, "t", step, g, residual)
        expected = core.encode(g, name="t", step=step)
        assert np.array_equal(payload, expected)
        np.testing.assert_array_equal(_pipeline.decode_sum(expected, single=True, shape=(numel,)),
                                      core.decode(expected, (numel,)))


def elias_fano_container(section, n, numel, index_params=b""):
    """A sparse container of n raw float32 ones whose Elias-Fano index section is ``section``."""
    c = container.Container(shape=(numel,), n=n, index_id=6, value_id=0, index_params=index_params,
                            value_params=b"", index_section=bytes(section),
                            value_section=np.ones(n, np.float32).tobytes(), perm_section=b"")
    c.digest = bytes(8)
    return container.pack(c)


def test_cpp_elias_fano_refuses_bad_sections_with_the_cores_error():
    core = deepreduce.build(config("elias_fano", memory="none"))
    good = bytearray(core.index.encode(np.array([3, 40, 41, 999]), np.ones(4, np.float32),
                                       np.zeros(1000, np.float32), None).payload)
    padded = bytearray(good)
    padded[-1] |= 0x80            # 4 * 7 + 4 + 7 = 39 bits: bit 39 is padding
    extra_one = bytearray(good)
    extra_one[4] |= 0x08          # a fifth upper bit (stream bits 28-38 are the upper bits)
    repeated = bytes([0x0F])      # 4 of 5 (L = 0): upper bits 0-3 decode to 0, 0, 0, 0
    cases = [(elias_fano_container(good[:-1], 4, 1000), "bytes, expected"),
             (elias_fano_container(good, 4, 1000, index_params=b"\x01"), "bytes, expected"),
             (elias_fano_container(padded, 4, 1000), "non-zero padding"),
             (elias_fano_container(extra_one, 4, 1000), "upper bits hold 5 entries"),
             (elias_fano_container(bytes(len(good)), 4, 1000), "upper bits hold 0 entries"),
             (elias_fano_container(repeated, 4, 5), "out of range or not increasing")]
    for buf, text in cases:
        with pytest.raises(deepreduce.ContainerError, match=text) as expected:
            core.decode(buf, None)
        with pytest.raises(ValueError) as got:   # ContainerError's kind reaches Python as ValueError
            _pipeline.decode_sum(buf, single=True)
        assert str(got.value) == str(expected.value)


SHARD_CONFIGS = [config(i, value=v) for i in ("raw", "elias_fano") for v in ("raw", "fp16", "polyfit")] \
    + [config("bloom", p, "polyfit") for p in ("p0", "p2")] + [config("elias_fano", memory="none"),
                                                              dict(config("elias_fano"), nonfinite="raise")]


def shard_bounds(numel, ranks, rng):
    """Uneven boundaries with empty shards among them."""
    cuts = np.sort(rng.integers(0, numel + 1, ranks - 1))
    cuts[: ranks // 3] = cuts[0]   # several empty shards in a row
    return np.concatenate([[0], cuts, [numel]]).astype(np.int64)


@pytest.mark.parametrize("cfg", SHARD_CONFIGS, ids=config_id)
def test_cpp_encode_shards_is_the_cores(cfg, monkeypatch):
    fast, slow = deepreduce.build(cfg), deepreduce.build(cfg)
    assert fast.native_reason() is None and fast.native is not None
    numel = 20000
    rng = np.random.default_rng(11)
    for step, ranks in enumerate((1, 2, 5, 16, 64)):
        bounds = shard_bounds(numel, ranks, rng) if ranks > 2 else (np.arange(ranks + 1) * numel) // ranks
        g = (rng.standard_normal(numel) * 0.01).astype(np.float32)
        if step == 3:
            g[123] = np.inf   # every shard dense and flagged, the residual untouched
        got = encode_shards(fast, g, "w", step, bounds)
        with monkeypatch.context() as m:
            m.setattr(native_pipeline, "module", lambda: None)
            expected = encode_shards(slow, g, "w", step, bounds)
        assert len(got) == len(expected) == ranks
        for j, (a, b) in enumerate(zip(got, expected)):
            assert np.array_equal(a, b), f"step {step}, shard {j}"
        if fast.memory.stateful:
            np.testing.assert_array_equal(fast.memory.residual("w"), slow.memory.residual("w"))
    assert fast.stats.as_dict() | {"encode_seconds": 0} == slow.stats.as_dict() | {"encode_seconds": 0}


def test_cpp_encode_shards_refuses_an_overflowing_compensation_as_the_core_does(monkeypatch):
    fast, slow = deepreduce.build(config("elias_fano")), deepreduce.build(config("elias_fano"))
    big = np.full(4000, 3e38, np.float32)
    bounds = [0, 1000, 4000]
    outcomes = []
    for core, native in ((fast, True), (slow, False)):
        with monkeypatch.context() as m:
            if not native:
                m.setattr(native_pipeline, "module", lambda: None)
            encode_shards(core, big, "w", 0, bounds)
            with pytest.raises(deepreduce.NonFiniteGradientError) as exc:
                encode_shards(core, big, "w", 1, bounds)
        outcomes.append((type(exc.value), str(exc.value), core.memory.residual("w").copy()))
    assert outcomes[0][:2] == outcomes[1][:2]
    np.testing.assert_array_equal(outcomes[0][2], outcomes[1][2])
