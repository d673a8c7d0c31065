"""Property tests: CRC-valid, field-aware mutations of valid containers of every config.

Each example takes a valid container of one config (formats v2 and v1), changes header numbers,
codec parameters or section bytes, packs it again with a correct CRC, and hands it to
``inspect``, ``decode`` (with and without the expected shape) and ``decode_sum``. Whatever the
bytes, only a DeepReduceError may come out, a decoded tensor is finite unless the header carries
the non-finite flag, and the memory Python allocates (tracemalloc sees every NumPy buffer) stays
within a constant times the expected tensor plus the payload. The wall-time bound is a generous
hang detector, not a benchmark. ``HOSTILE_EXAMPLES`` sets the examples per config (default 50).
"""
import dataclasses
import functools
import os
import time
import tracemalloc

import numpy as np
import pytest
from hostile import CONFIGS, NUMEL, config_name, pack_v1, valid_container
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deepreduce
from deepreduce.errors import DeepReduceError
from deepreduce.wire import container

LIMIT = 1 << 16                 # the receivers' max_numel in these tests
MEMORY_FACTOR = 40              # bytes allocated per byte of expected tensor (float32) or payload
MEMORY_SLACK = 8 << 20
HANG_SECONDS = 60.0
EXAMPLES = int(os.environ.get("HOSTILE_EXAMPLES", "50"))

BIG = [0, 1, 2, 7, NUMEL - 1, NUMEL, NUMEL + 1, LIMIT, LIMIT + 1, 2**31, 2**32, 2**40, 2**63, 2**64 - 1]
SPECIAL_FLOATS = [np.nan, np.inf, -np.inf, 3.4e38, 1e-45, 0.0]


@functools.lru_cache(maxsize=None)
def case(path: str):
    pipe, payload = valid_container(path)
    pipe.max_numel = LIMIT
    return pipe, container.unpack(payload)


def _mutate_bytes(draw, data: bytes) -> bytes:
    op = draw(st.sampled_from(["flip", "set", "truncate", "extend", "replace", "empty"]))
    buf = bytearray(data)
    if op in ("flip", "set") and not buf:
        op = "extend"
    if op == "flip":
        pos = draw(st.integers(0, len(buf) - 1))
        buf[pos] ^= 1 << draw(st.integers(0, 7))
    elif op == "set":
        for _ in range(draw(st.integers(1, 4))):
            buf[draw(st.integers(0, len(buf) - 1))] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF]))
    elif op == "truncate":
        buf = buf[:draw(st.integers(0, len(buf)))]
    elif op == "extend":
        buf += draw(st.binary(min_size=1, max_size=16))
    elif op == "replace":
        buf = bytearray(draw(st.binary(max_size=48)))
    else:
        buf = bytearray()
    return bytes(buf)


@st.composite
def mutations(draw, base: container.Container):
    """A CRC-valid rewrite of ``base`` (bytes of a v2 or v1 container): one to three field changes,
    the header numbers, a codec's params, a section's bytes or one of its float32 slots."""
    c = dataclasses.replace(base)
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):
        where = draw(st.sampled_from(["shape", "n", "size", "flags", "ids", "perm", "params", "section", "float"]))
        if where == "shape":
            c.shape = tuple(draw(st.lists(st.sampled_from(BIG), max_size=3)))
        elif where == "n":
            c.n = draw(st.one_of(st.sampled_from(BIG), st.integers(0, 2 * NUMEL)))
        elif where == "size":   # a large tensor and count together, within the receiver's bound
            c.shape, c.n = (LIMIT,), draw(st.sampled_from([c.n, LIMIT // 2, LIMIT]))
        elif where == "flags":
            c.flags = draw(st.integers(0, 7))
        elif where == "ids":
            c.index_id, c.value_id = draw(st.integers(0, 9)), draw(st.integers(0, 9))
        elif where == "perm":
            c.perm_width = draw(st.sampled_from([0, 1, 12, 64, 65, 255]))
            c.flags |= container.FLAG_PERMUTED if c.perm_width else 0
        elif where == "params":
            name = draw(st.sampled_from(["index_params", "value_params"]))
            setattr(c, name, _mutate_bytes(draw, getattr(c, name)))
        elif where == "section":
            name = draw(st.sampled_from(["index_section", "value_section", "perm_section"]))
            setattr(c, name, _mutate_bytes(draw, getattr(c, name)))
        elif len(c.value_section) >= 4:   # a value slot set to NaN/Inf/huge/denormal
            buf = bytearray(c.value_section)
            pos = 4 * draw(st.integers(0, len(buf) // 4 - 1))
            buf[pos:pos + 4] = np.float32(draw(st.sampled_from(SPECIAL_FLOATS))).tobytes()
            c.value_section = bytes(buf)
    if draw(st.booleans()):
        return pack_v1(c)
    return container.pack(c).tobytes()


def _check_bounded(call, expected_numel: int, payload_bytes: int):
    """Run ``call``: only DeepReduceError escapes; memory and time stay bounded."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        result = call()
    except DeepReduceError:
        result = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    elapsed = time.monotonic() - start
    budget = MEMORY_FACTOR * (4 * expected_numel + payload_bytes) + MEMORY_SLACK
    assert peak <= budget, f"allocated {peak} bytes, bound {budget}"
    assert elapsed < HANG_SECONDS, f"took {elapsed:.1f} s: unbounded work"
    return result


@pytest.mark.parametrize("path", CONFIGS, ids=config_name)
def test_mutated_containers_raise_only_deepreduce_errors(path):
    pipe, base = case(path)

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(payload=mutations(base))
    def check(payload):
        buf = np.frombuffer(payload, dtype=np.uint8)
        info = _check_bounded(lambda: deepreduce.inspect(buf, max_numel=LIMIT), LIMIT, len(payload))
        for expected, numel in ((None, LIMIT), ((NUMEL,), NUMEL)):
            out = _check_bounded(lambda: pipe.decode(buf, expected_shape=expected), numel, len(payload))
            if out is not None and not (info and info["nonfinite"]):
                assert np.isfinite(out).all(), "decoded NaN/Inf without the non-finite flag"
        _check_bounded(lambda: pipe.decode_sum([buf, buf], expected_shape=(NUMEL,)), NUMEL, 2 * len(payload))

    check()


@pytest.mark.parametrize("path", CONFIGS, ids=config_name)
def test_mutated_containers_on_the_torch_device_path(path):
    """The same mutations decoded by the torch device path (array-namespace codecs on torch
    tensors, here on the CPU device): only DeepReduceError, finite output without the flag."""
    torch = pytest.importorskip("torch")
    from deepreduce.torch.pipeline import TorchPipeline

    pipe, base = case(path)
    device_pipe = TorchPipeline(pipe, path="device")

    @settings(max_examples=max(1, EXAMPLES // 2), deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True)
    @given(payload=mutations(base))
    def check(payload):
        buf = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy())
        nonfinite = bool(buf.numel() > 5 and int(buf[5]) & container.FLAG_NONFINITE)
        for expected in (None, (NUMEL,)):
            try:
                out = device_pipe.decode(buf, expected_shape=expected, device="cpu")
            except DeepReduceError:
                continue
            assert nonfinite or bool(torch.isfinite(out).all()), "decoded NaN/Inf without the non-finite flag"

    check()
