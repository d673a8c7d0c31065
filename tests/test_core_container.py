"""Container format v1: layout, inspection, and rejection of every malformed buffer."""
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import deepreduce
from deepreduce import ContainerError, container

TOPK = {"sparsifier": {"id": "topk", "ratio": 0.05}, "index": "raw", "value": "raw", "memory": "none",
        "min_numel": 0}


@pytest.fixture(scope="module")
def payload():
    grad = np.random.default_rng(1).standard_normal((40, 25)).astype(np.float32)
    return deepreduce.build(TOPK).encode(grad, name="w", step=3)


def test_topk_container_size_matches_documented_formula(payload):
    # docs/container-format.md: 52 + 8*ndim header bytes, then 4r index bytes and 4r value bytes.
    r = int(0.05 * 1000)
    assert payload.size == container.overhead(ndim=2) + 4 * r + 4 * r == 52 + 16 + 8 * r


def test_inspect_reports_header(payload):
    info = deepreduce.inspect(payload)
    assert info["format_version"] == 1 and info["shape"] == (40, 25) and info["n"] == 50
    assert info["index_codec"] == "raw" and info["value_codec"] == "raw"
    assert info["index_bytes"] == info["value_bytes"] == 200 and not info["dense"]


def test_every_truncation_is_rejected(payload):
    for length in range(payload.size):
        with pytest.raises(ContainerError):
            container.unpack(payload[:length])


def test_every_single_flipped_byte_is_rejected(payload):
    pipe = deepreduce.build(TOPK)
    for pos in range(payload.size):
        for mask in (0x01, 0x80):
            corrupt = payload.copy()
            corrupt[pos] ^= mask
            with pytest.raises(ContainerError):
                pipe.decode(corrupt)


def test_foreign_and_malformed_buffers_are_rejected():
    pipe = deepreduce.build(TOPK)
    for junk in (b"", b"PK\x03\x04" + bytes(100), np.zeros(200, np.uint8), np.arange(64, dtype=np.uint8)):
        with pytest.raises(ContainerError):
            pipe.decode(np.frombuffer(bytes(junk), np.uint8) if isinstance(junk, bytes) else junk)
    with pytest.raises(ContainerError, match="1-D uint8"):
        pipe.decode(np.zeros(10, np.float32))


def _recrc(buf: np.ndarray) -> np.ndarray:
    body = buf[:-4].tobytes()
    return np.frombuffer(body + struct.pack("<I", zlib.crc32(body)), np.uint8).copy()


def test_semantic_checks_behind_a_valid_checksum(payload):
    pipe = deepreduce.build(TOPK)
    c = container.unpack(payload)
    out_of_range = c.index_section[:-4] + struct.pack("<I", 10**6)
    repeated = c.index_section[:-4] + c.index_section[:4]
    for section in (out_of_range, repeated, c.index_section[:-4]):
        bad = container.pack(container.Container(**{**c.__dict__, "index_section": section}))
        with pytest.raises(ContainerError):
            pipe.decode(bad)
    version2 = payload.copy()
    version2[4] = 2
    with pytest.raises(ContainerError, match="version 2"):
        pipe.decode(_recrc(version2))
    unknown_codec = payload.copy()
    unknown_codec[6] = 250
    with pytest.raises(ContainerError, match="wire id 250"):
        pipe.decode(_recrc(unknown_codec))


def test_split_recovers_concatenated_containers(payload):
    other = deepreduce.build(TOPK).encode(np.ones(7, np.float32), name="b")
    parts = container.split(np.concatenate([payload, other, payload]))
    assert [p.size for p in parts] == [payload.size, other.size, payload.size]
    with pytest.raises(ContainerError, match="truncated"):
        container.split(np.concatenate([payload, other[:-1]]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=0, max_size=3), st.integers(0, 2**31))
def test_dense_and_sparse_round_trip_any_shape(shape, seed):
    grad = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    for min_numel in (0, 10**6):
        pipe = deepreduce.build(dict(TOPK, min_numel=min_numel, sparsifier={"id": "none"}))
        out = pipe.decode(pipe.encode(grad, name="t", step=seed))
        assert out.shape == grad.shape and out.dtype == np.float32
        np.testing.assert_array_equal(out, grad)
