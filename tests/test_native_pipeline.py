"""The C++ pipeline subset (csrc/pipeline, bound as deepreduce._pipeline, the code the TensorFlow ops
run) writes the core pipeline's bytes, keeps its residuals and refuses what it refuses with its
texts, for every config whose stages exist in C++ -- checked here without TensorFlow."""
import glob
import os
import zlib

import numpy as np
import pytest

import deepreduce
from deepreduce.backend import native_pipeline
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
                if native_pipeline.unsupported(deepreduce.build(c)) is None]
CONFIGS = FILE_CONFIGS + [config("bloom", p, v, m) for p in bloom_codec.POLICIES for v in ("raw", "fp16", "polyfit")
                          for m in ("none", "residual")] \
    + [config("raw", value=v) for v in ("raw", "fp16", "polyfit")] \
    + [dict(config(i, "p1", v), sparsifier={"id": "threshold", "threshold": 0.02})
       for i in ("raw", "bloom") for v in ("raw", "polyfit")]


def config_id(c):
    if isinstance(c, str):
        return os.path.basename(c)
    return f"{c['sparsifier']['id']}-{c['index'].get('policy', c['index']['id'])}-{c['value']['id']}-{c['memory']['id']}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
def test_cpp_pipeline_writes_and_reads_the_cores_bytes(cfg):
    core, peer = deepreduce.build(cfg), deepreduce.build(cfg)
    settings = native_pipeline.settings(core)
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


@pytest.mark.parametrize("cfg", [config("bloom", "p2", "polyfit"), config("raw", value="fp16"), config("bloom", "p0")],
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
    assert "qsgd" in native_pipeline.unsupported(deepreduce.build(os.path.join(ROOT, "configs", "qsgd.yaml")))
    # the C++ pipeline has no warm-up: such a config runs through the core in every binding
    warm = dict(deepreduce.load_config(os.path.join(ROOT, "configs", "topk_raw.yaml")), warmup=3)
    assert "warmup" in native_pipeline.unsupported(deepreduce.build(warm))
