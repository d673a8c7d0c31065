"""Container format v2 (and reading v1): layout, inspection, and rejection of every malformed buffer."""
import glob
import os
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import deepreduce
from deepreduce import ContainerError
from deepreduce.wire import container, varint

TOPK = {"sparsifier": {"id": "topk", "ratio": 0.05}, "index": "raw", "value": "raw", "memory": "none",
        "min_numel": 0}
V1_FIXTURES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "golden", "v1", "*.npz")))


@pytest.fixture(scope="module")
def payload():
    grad = np.random.default_rng(1).standard_normal((40, 25)).astype(np.float32)
    return deepreduce.build(TOPK).encode(grad, name="w", step=3)


@pytest.fixture(scope="module")
def v1_payload():
    return np.load([p for p in V1_FIXTURES if p.endswith("config_topk_raw.npz")][0])["payload"]


def test_topk_container_size_matches_documented_formula(payload):
    # docs/container-format.md: 18 fixed bytes, varints n=50, Pi=Pv=0, Li=Lv=200, Lp=0 and the two
    # dimensions (1+1+1+2+2+1 + 1+1 bytes), 4r index bytes, 4r value bytes, the CRC.
    r = int(0.05 * 1000)
    assert payload.size == container.overhead((40, 25), r, 4 * r, 4 * r) + 8 * r == 18 + 10 + 4 + 8 * r


def test_v2_header_is_smaller_than_v1(payload):
    ndim = 2
    v1_overhead = 48 + 8 * ndim + 4
    assert payload.size - 8 * 50 < v1_overhead


def test_inspect_reports_header_and_digest(payload):
    info = deepreduce.inspect(payload)
    assert info["format_version"] == 2 and info["shape"] == (40, 25) and info["n"] == 50
    assert info["index_codec"] == "raw" and info["value_codec"] == "raw"
    assert info["index_bytes"] == info["value_bytes"] == 200 and not info["dense"]
    assert info["config_digest"] == deepreduce.build(TOPK)._digest[:8].hex()


def test_digest_tells_configs_apart(payload):
    other = deepreduce.build(dict(TOPK, sparsifier={"id": "topk", "ratio": 0.06}))
    grad = np.random.default_rng(1).standard_normal((40, 25)).astype(np.float32)
    c_same, c_other = container.unpack(payload), container.unpack(other.encode(grad, name="w", step=3))
    assert len(c_same.digest) == container.DIGEST_SIZE
    assert c_same.digest != c_other.digest
    small = deepreduce.build(dict(TOPK, min_numel=10))
    dense = container.unpack(small.encode(np.ones(3, np.float32), name="b"))
    assert dense.dense and dense.digest == small._digest[:8]   # dense containers carry it too


def _all_payloads(payload, v1_payload):
    return [("v2", payload), ("v1", v1_payload)]


def test_every_truncation_is_rejected(payload, v1_payload):
    for _, buf in _all_payloads(payload, v1_payload):
        for length in range(buf.size):
            with pytest.raises(ContainerError):
                container.unpack(buf[:length])


def test_every_single_flipped_byte_is_rejected(payload, v1_payload):
    pipe = deepreduce.build(TOPK)
    for _, buf in _all_payloads(payload, v1_payload):
        for pos in range(buf.size):
            for mask in (0x01, 0x80):
                corrupt = buf.copy()
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
    version3 = payload.copy()
    version3[4] = 3
    with pytest.raises(ContainerError, match="version 3"):
        pipe.decode(_recrc(version3))
    unknown_codec = payload.copy()
    unknown_codec[6] = 250
    with pytest.raises(ContainerError, match="wire id 250"):
        pipe.decode(_recrc(unknown_codec))
    unknown_flag = payload.copy()
    unknown_flag[5] |= 0x40
    with pytest.raises(ContainerError, match="flags"):
        pipe.decode(_recrc(unknown_flag))


def _v2_with_numbers(c, numbers):
    """A v2 container whose varint fields are replaced by ``numbers`` (raw bytes each)."""
    head = container._V2.pack(container.MAGIC, 2, c.flags, c.index_id, c.value_id, len(c.shape), c.perm_width,
                              c.digest)
    body = head + b"".join(numbers) + c.index_params + c.value_params + c.index_section + c.value_section
    return np.frombuffer(body + struct.pack("<I", zlib.crc32(body)), np.uint8).copy()


def test_varint_fields_are_checked_by_name(payload):
    c = container.unpack(payload)
    fields = [c.n, 0, 0, len(c.index_section), len(c.value_section), 0, *c.shape]
    good = [varint.encode(v) for v in fields]
    assert _v2_with_numbers(c, good).tobytes() == payload.tobytes()
    cases = {
        0: (varint.encode(c.n)[:-1] + bytes([varint.encode(c.n)[-1] | 0x80, 0x00]), "n .*shortest"),
        3: (b"\xff" * 11, "index section length .*longer"),
        6: (b"\xff" * 9 + b"\x7f", "shape\\[0\\] .*exceeds"),
        1: (varint.encode(70000), "index params length is 70000"),
    }
    for slot, (raw, message) in cases.items():
        numbers = list(good)
        numbers[slot] = raw
        with pytest.raises(ContainerError, match=message):
            container.unpack(_v2_with_numbers(c, numbers))
    with pytest.raises(ContainerError, match="length mismatch"):
        container.unpack(_v2_with_numbers(c, good[:3] + [varint.encode(len(c.index_section) + 1)] + good[4:]))


def test_split_recovers_concatenated_containers_of_both_versions(payload, v1_payload):
    other = deepreduce.build(TOPK).encode(np.ones(7, np.float32), name="b")
    parts = container.split(np.concatenate([payload, v1_payload, other, payload]))
    assert [p.size for p in parts] == [payload.size, v1_payload.size, other.size, payload.size]
    assert [container.unpack(p).version for p in parts] == [2, 1, 2, 2]
    for cut in (other[:-1], v1_payload[:-1], v1_payload[:30], payload[:12]):
        with pytest.raises(ContainerError, match="truncated"):
            container.split(np.concatenate([payload, cut]))


def test_a_split_segment_is_unpacked_where_it_lies_and_its_sections_outlive_the_receive(payload, v1_payload):
    """unpack reads a host segment's header and checksum in place (no copy of the container) and
    copies each section once, so the container stays valid when the receive buffer is reused."""
    received = np.concatenate([v1_payload, payload])
    parts = container.split(received)
    assert np.shares_memory(np.frombuffer(container._in_place(parts[1]), np.uint8), received)
    expected = [container.unpack(bytes(p)) for p in parts]
    got = [container.unpack(p) for p in parts]
    assert got == expected and all(type(c.value_section) is bytes for c in got)
    received[:] = 0   # the transport reuses its buffer
    assert got == expected
    with pytest.raises(ContainerError, match=r"magic b'\\x00\\x00\\x00\\x00'"):
        container.unpack(parts[1])


def test_pack_refuses_what_the_format_cannot_hold():
    with pytest.raises(ContainerError, match="dimensions"):
        container.pack(container.Container(shape=(1,) * 33, n=0, index_id=0, value_id=0))
    with pytest.raises(ContainerError, match="65535"):
        container.pack(container.Container(shape=(1,), n=0, index_id=0, value_id=0, index_params=bytes(70000)))
    with pytest.raises(ContainerError, match="digest"):
        container.pack(container.Container(shape=(1,), n=0, index_id=0, value_id=0, digest=b"\x01"))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**64 - 1))
def test_varint_round_trip(value):
    raw = varint.encode(value)
    assert len(raw) == varint.size(value) <= varint.MAX_BYTES
    assert varint.decode(raw + b"\x00", 0, "x") == (value, len(raw))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=0, max_size=3), st.integers(0, 2**31))
def test_dense_and_sparse_round_trip_any_shape(shape, seed):
    grad = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    for min_numel in (0, 10**6):
        pipe = deepreduce.build(dict(TOPK, min_numel=min_numel, sparsifier={"id": "none"}))
        out = pipe.decode(pipe.encode(grad, name="t", step=seed))
        assert out.shape == grad.shape and out.dtype == np.float32
        np.testing.assert_array_equal(out, grad)
