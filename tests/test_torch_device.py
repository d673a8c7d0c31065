"""The torch device path: the core's codecs run on torch tensors on their own device.

Run on CPU torch in CI, and on CUDA as well when a GPU is present (the ``device`` fixture).

* **Byte-identical** (the device path writes the NumPy core's exact container bytes):
  ``BYTE_IDENTICAL`` below (Top-r/threshold/SIDCo/Random-r/DGC selection, raw/fp16/QSGD values,
  raw/Bloom (every policy)/run-length/Elias-Fano/delta indices, dense and non-finite containers, error feedback).
* **Decode-compatible**: the float codecs (polyfit, dexp, sketchml, deflate) and Huffman /
  delta-Huffman indices run on the host for device tensors (one-time warning), so their bytes are the core's
  too; decoding any of their containers on the device gives the host's tensor
  (``DECODE_COMPATIBLE``).
"""
import glob
import json
import os
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deepreduce
from deepreduce.backend import arrays
from deepreduce.index import bloom as bl
from deepreduce.torch.pipeline import build as torch_build

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BYTE_IDENTICAL = ["topk_raw", "bf_naive", "bf_p0", "bf_p1", "bf_p2", "bfp0_qsgd", "qsgd", "threshold",
                  "sidco_exp", "dgc", "rle", "elias_fano", "core_topk_fp16", "core_randomk_raw"]
DECODE_COMPATIBLE = ["polyfit", "bfp2_polyfit", "dexp", "sketchml", "deflate", "huffman"]
EXTRA = {
    "core_topk_fp16": {"sparsifier": {"id": "topk", "ratio": 0.05}, "index": {"id": "raw"},
                       "value": {"id": "fp16"}, "memory": {"id": "residual"}},
    "core_randomk_raw": {"sparsifier": {"id": "randomk", "ratio": 0.02}, "index": {"id": "raw"},
                         "value": {"id": "raw"}, "memory": {"id": "none"}},
    "bf_leftmost": {"sparsifier": {"id": "topk", "ratio": 0.01}, "index": {"id": "bloom", "policy": "middle"},
                    "value": {"id": "raw"}, "memory": {"id": "residual"}},
}


GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
FIXTURES = sorted(glob.glob(os.path.join(GOLDEN, "*.npz")) + glob.glob(os.path.join(GOLDEN, "v1", "*.npz")))


def _config(name):
    return EXTRA.get(name, f"configs/{name}.yaml")


def _pipelines(name, device):
    return deepreduce.build(_config(name)), torch_build(deepreduce.build(_config(name)), path="device")


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def _gradient(seed, d, scale=1.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_t(3, d) * scale).astype(np.float32)


@pytest.mark.parametrize("name", BYTE_IDENTICAL + ["bf_leftmost"])
def test_device_path_writes_the_core_bytes_over_steps(name, device):
    core, dev = _pipelines(name, device)
    for step in range(3):
        g = _gradient(step, 6000)
        expected = core.encode(g, name="w", step=step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # P2's host fallback warns once
            got = dev.encode(torch.from_numpy(g).to(device), name="w", step=step)
        assert got.dtype == torch.uint8 and got.device.type == device.type
        np.testing.assert_array_equal(got.cpu().numpy(), expected)
        decoded = dev.decode(got, device=device)
        assert decoded.device.type == device.type
        np.testing.assert_array_equal(decoded.cpu().numpy(), core.decode(expected))
    residual = core.memory.residual("w") if core.memory.stateful else None
    if residual is not None:
        np.testing.assert_array_equal(dev.core.memory.residual("w").cpu().numpy(), residual)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(d=st.integers(1000, 30000), ratio=st.sampled_from([0.001, 0.01, 0.05, 0.2]),
       policy=st.sampled_from(["naive", "p0", "p1", "leftmost", "middle", "rightmost"]),
       value=st.sampled_from(["raw", "fp16", "qsgd"]), index=st.sampled_from(["bloom", "raw", "rle", "elias_fano", "delta"]),
       seed=st.integers(0, 2**32 - 1), step=st.integers(0, 10**6), hash_seed=st.integers(0, 2**64 - 1))
def test_hypothesis_byte_identity(device, d, ratio, policy, value, index, seed, step, hash_seed):
    config = {"sparsifier": {"id": "topk", "ratio": ratio}, "value": {"id": value}, "memory": {"id": "residual"},
              "index": {"id": "bloom", "policy": policy, "hash_seed": hash_seed} if index == "bloom" else {"id": index}}
    core, dev = deepreduce.build(config), torch_build(deepreduce.build(config), path="device")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # no host fallback on this path
        for s in (step, step + 1):
            g = _gradient(seed + s, d)
            expected = core.encode(g, name="t", step=s)
            got = dev.encode(torch.from_numpy(g).to(device), name="t", step=s)
            np.testing.assert_array_equal(got.cpu().numpy(), expected)
        np.testing.assert_array_equal(dev.decode(got, device=device).cpu().numpy(), core.decode(expected))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 3000), blocks=st.integers(1, 40), k=st.integers(1, 12), seed=st.integers(0, 2**64 - 1),
       draw=st.integers(0, 2**64 - 1))
def test_bloom_hash_build_query_p1_identical_on_torch(n, blocks, k, seed, draw):
    d = 5000
    idx = np.sort(np.random.default_rng(seed % 2**32).choice(d, min(n, d), replace=False)).astype(np.uint64)
    host = bl.np_build(idx, blocks, k, seed)
    dev = bl.build(torch.from_numpy(idx.astype(np.int64)), blocks, k, seed)
    assert bytes(dev.numpy()) == host
    P = bl.np_query(host, blocks, k, seed, d, d)
    P_dev = bl.query(dev, blocks, k, seed, d, d, like=dev)
    np.testing.assert_array_equal(P_dev.numpy(), P.astype(np.int64))
    r = min(idx.size, P.size)
    np.testing.assert_array_equal(bl.select_random(P_dev, r, draw).numpy(),
                                  bl.np_select_random(P, r, draw).astype(np.int64))


@settings(max_examples=30, deadline=None)
@given(words=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=50), m=st.integers(1, 2**64 - 1))
def test_uint64_word_arithmetic_matches_numpy(words, m):
    x = np.array(words, dtype=np.uint64)
    t = torch.from_numpy(x.view(np.int64))
    np.testing.assert_array_equal(bl.mix64(t).numpy(), bl.mix64(x).view(np.int64))
    np.testing.assert_array_equal(bl.mulhi64(t, m).numpy(), bl.mulhi64(x, m).view(np.int64))
    a = arrays.adapter(t)
    assert torch.equal(torch.argsort(a.order_key(t), stable=True), torch.from_numpy(np.argsort(x, kind="stable")))


@pytest.mark.parametrize("name", DECODE_COMPATIBLE)
def test_float_codecs_decode_compatible_on_device(name, device):
    core, dev = _pipelines(name, device)
    g = _gradient(5, 8000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = dev.encode(torch.from_numpy(g).to(device), name="w", step=2)
        host = core.encode(g, name="w", step=2)
        decoded = dev.decode(got, device=device)
    np.testing.assert_allclose(decoded.cpu().numpy(), core.decode(host), rtol=0, atol=0)


def test_core_pipeline_accepts_torch_tensors_directly(device):
    core = deepreduce.build("configs/bf_p0.yaml")
    g = _gradient(9, 7000)
    got = core.encode(torch.from_numpy(g).to(device), name="w", step=4)
    np.testing.assert_array_equal(got.cpu().numpy(), deepreduce.build("configs/bf_p0.yaml").encode(g, name="w", step=4))


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: os.path.relpath(p, GOLDEN)[:-4])
def test_golden_fixtures_on_the_device_path(path, device):
    """Every config's v2 fixture is re-encoded to its bytes on the device; v2 and v1 fixtures
    decode on the device to the tensors the host decoded them to."""
    data = np.load(path)
    dev = torch_build(json.loads(str(data["config"])), path="device")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # host fallbacks and dense-gradient notices
        if "/v1/" not in path.replace(os.sep, "/"):
            got = dev.encode(torch.from_numpy(data["grad"]).to(device), name=str(data["tensor_name"]),
                             step=int(data["step"]))
            np.testing.assert_array_equal(got.cpu().numpy(), data["payload"])
        decoded = dev.decode(torch.from_numpy(data["payload"]).to(device), device=device)
    assert decoded.device.type == device.type
    np.testing.assert_array_equal(decoded.cpu().numpy(), data["decoded"])


def test_nonfinite_and_small_tensors_are_identical(device):
    core, dev = _pipelines("topk_raw", device)
    for g in (np.array([1.0, np.nan, 3.0] * 500, dtype=np.float32), np.arange(10, dtype=np.float32)):
        expected = core.encode(g, name="x", step=0)
        got = dev.encode(torch.from_numpy(g).to(device), name="x", step=0)
        np.testing.assert_array_equal(got.cpu().numpy(), expected)


def test_decode_sum_accumulates_into_a_device_buffer(device):
    core, dev = _pipelines("bf_p0", device)
    grads = [_gradient(r, 5000).reshape(50, 100) for r in range(3)]
    payloads = [dev.encode(torch.from_numpy(g).to(device), name=f"r{r}", step=1) for r, g in enumerate(grads)]
    out = torch.full((50, 100), 7.0, device=device)
    dev.decode_sum(payloads, out=out)
    expected = core.decode_sum([p.cpu().numpy() for p in payloads])
    np.testing.assert_array_equal(out.cpu().numpy(), expected)


def _raw_container(indices, values, numel=100):
    """A raw-index, raw-value container of ``numel`` elements as written (no checks at pack)."""
    from deepreduce.wire import container

    return container.pack(container.Container(
        shape=(numel,), n=len(indices), index_id=0, value_id=0,
        index_section=np.asarray(indices).astype("<u4").tobytes(),
        value_section=np.asarray(values, dtype="<f4").tobytes()))


RAW = {"sparsifier": {"id": "topk", "ratio": 0.05}, "index": {"id": "raw"}, "value": {"id": "raw"},
       "memory": {"id": "none"}}


@pytest.mark.parametrize("indices,values,message", [
    ([3, 9, 3], [1, 1, 1], "repeats an index"), ([5, 100], [1, 1], "out of range"),
    ([5, 4000000], [1, 1], "out of range"), ([1, 2], [np.nan, 1], "hold NaN/Inf")])
@pytest.mark.parametrize("on_device", [False, True], ids=["host-payloads", "device-payloads"])
def test_device_decode_rejects_what_the_host_rejects(device, indices, values, message, on_device):
    """The device decode's checks are read back once, after the scatter (deferred_checks): the
    error is the host path's, names the rank, an out-of-range index never reaches the device's
    scatter, and the device decodes correctly afterwards."""
    pipe = torch_build(deepreduce.build(RAW), path="device")
    good, bad = _raw_container([1, 2], [1.0, 2.0]), _raw_container(indices, values)
    wrap = (lambda p: torch.from_numpy(p).to(device)) if on_device else (lambda p: p)
    with pytest.raises(deepreduce.ContainerError, match=message):
        pipe.core.decode(np.asarray(bad))
    out = torch.zeros(100, device=device)
    with pytest.raises(deepreduce.ContainerError, match=message):
        pipe.decode(wrap(bad), out=out)
    with pytest.raises(deepreduce.ContainerError, match="rank 1: .*" + message):
        pipe.decode_sum([wrap(good), wrap(bad), wrap(good)], out=out)
    pipe.decode_sum([wrap(good), wrap(good)], out=out)
    expected = np.zeros(100, np.float32)
    expected[[1, 2]] = [2.0, 4.0]
    np.testing.assert_array_equal(out.cpu().numpy(), expected)


def test_device_decode_sum_overflow_and_first_failure_named(device):
    """nonfinite='raise': finite values whose sum overflows raise on the device as on the host;
    of two bad containers the first (in rank order) is reported."""
    pipe = torch_build(deepreduce.build(dict(RAW, nonfinite="raise")), path="device")
    big = _raw_container([7], [3e38])
    out = torch.zeros(100, device=device)
    with pytest.raises(deepreduce.NonFiniteGradientError, match="rank 1: the sum of the ranks"):
        pipe.decode_sum([big, big], out=out)
    with pytest.raises(deepreduce.ContainerError, match="rank 1: .*repeats an index"):
        pipe.decode_sum([big, _raw_container([3, 3], [1, 1]), _raw_container([1], [np.inf])], out=out)
    # a deferred failure of rank 1 comes before an immediate one of rank 2 (another shape), as on the host
    other_shape = _raw_container([1], [1.0], numel=50)
    for decode in (pipe.core.decode_sum, pipe.decode_sum):
        target = np.zeros(100, np.float32) if decode is pipe.core.decode_sum else out
        with pytest.raises(deepreduce.ContainerError, match="rank 1: .*repeats an index"):
            decode([big, _raw_container([3, 3], [1, 1]), other_shape], expected_shape=(100,), out=target)


def test_device_payload_sections_stay_on_the_device(device):
    """A container that is a tensor on the output's device is decoded from slices of itself."""
    from deepreduce.wire import container

    payload = torch.from_numpy(_raw_container([4, 8], [0.5, -1.5])).to(device)
    like = torch.zeros(1, device=device)
    c = container.unpack(payload, sections_like=like)
    if device.type == "cpu":   # a host payload's sections are bytes
        assert isinstance(c.index_section, bytes)
    else:
        assert c.index_section.device.type == device.type and c.value_section.data_ptr() == payload[-12:-4].data_ptr()
    assert bytes(arrays.head_bytes(c.value_section, 8)) == np.array([0.5, -1.5], "<f4").tobytes()


def test_u4_sections_widen_without_sign(device):
    """Unsigned 32-bit words read from a section on the device equal NumPy's, the top bit included."""
    words = np.array([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 123456789], dtype="<u4")
    like = torch.zeros(1, device=device)
    got = arrays.adapter(like).from_section(words.tobytes(), "<u4", like)
    assert got.dtype == torch.int64 and got.device.type == device.type
    np.testing.assert_array_equal(got.cpu().numpy(), words.astype(np.int64))


def test_host_fallback_warns_once_naming_the_component():
    arrays._fallbacks.discard("value codec 'dexp'")
    dev = torch_build("configs/dexp.yaml", path="device")
    with pytest.warns(RuntimeWarning, match="value codec 'dexp'"):
        dev.encode(torch.from_numpy(_gradient(0, 4000)), name="a", step=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        dev.encode(torch.from_numpy(_gradient(1, 4000)), name="a", step=1)


@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.integers(0, 2**56 - 1), max_size=300), width_extra=st.integers(0, 8))
def test_bitpack_identical_on_torch(values, width_extra):
    from deepreduce.wire import bitpack

    x = np.array(values, dtype=np.uint64)
    width = min(56, bitpack.width_for(int(x.max()) if x.size else 0) + width_extra)
    host = bitpack.pack(x, width)
    dev = bitpack.pack(torch.from_numpy(x.view(np.int64)), width)
    assert (dev if isinstance(dev, bytes) else bytes(dev.numpy())) == host
    back = bitpack.unpack(torch.frombuffer(bytearray(host), dtype=torch.uint8) if host else torch.zeros(0, dtype=torch.uint8),
                          width, x.size)
    np.testing.assert_array_equal(back.numpy(), x.view(np.int64))


def test_backends_report_where_each_component_runs():
    dev = torch_build("configs/bfp2_polyfit.yaml", path="device")
    report = dev.backends("cpu")
    assert report["index"] == "torch on cpu (c++ kernels on its memory)" and report["memory"] == "torch on cpu"
    assert report["value"].startswith("host")
    host = torch_build("configs/bf_p0.yaml").backends("cpu")
    assert all(v.startswith("host") for v in host.values())


@CUDA
def test_cuda_container_never_leaves_the_device_but_for_its_crc():
    dev = torch_build("configs/bf_p0.yaml")   # auto: CUDA tensors take the device path
    g = torch.randn(20000, device="cuda")
    payload = dev.encode(g, name="w", step=0)
    assert payload.device.type == "cuda"
    out = torch.zeros_like(g)
    dev.decode_sum([payload], out=out)
    assert out.device.type == "cuda"
