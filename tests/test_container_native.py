"""The C++ container code (csrc/container, module deepreduce._container, also compiled into the
TensorFlow ops) against deepreduce/wire/container.py: the same bytes packed, the same fields parsed,
the same error text for every bad buffer."""
import os
import zlib
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepreduce.errors import ContainerError, DeepReduceError
from deepreduce.wire import container

native = pytest.importorskip("deepreduce._container", reason="needs the C++ extensions (make setup)")

sections = st.binary(max_size=40)


@st.composite
def containers(draw):
    permuted = draw(st.booleans())
    return container.Container(
        shape=tuple(draw(st.lists(st.integers(0, 2**15), max_size=4))),
        n=draw(st.integers(0, 2**64 - 1)), index_id=draw(st.integers(0, 255)), value_id=draw(st.integers(0, 255)),
        flags=draw(st.integers(0, 7)), perm_width=draw(st.integers(1, 64)) if permuted else 0,
        index_params=draw(sections), value_params=draw(sections), index_section=draw(sections),
        value_section=draw(sections), perm_section=draw(sections) if permuted else b"",
        digest=draw(st.one_of(st.none(), st.binary(min_size=8, max_size=8))))


def python_pack(c):
    """container.pack's pure-Python path (the extension is bypassed)."""
    import deepreduce.backend._native as native_policy

    saved = native_policy._cache.get("container")
    native_policy._cache["container"] = None
    try:
        return container.pack(c)
    finally:
        native_policy._cache["container"] = saved


def parse(parser, buf):
    try:
        return "ok", parser(buf)
    except (ContainerError, ValueError) as exc:
        return "error", str(exc)


def python_header(buf):
    # the parse alone, by the Python path (container.unpack uses the twin when it is built); the
    # receiver's size bound (max_numel, docs/reliability.md) is lifted
    with mock.patch.dict(os.environ, {"DEEPREDUCE_BACKEND": "numpy"}):
        c = container.unpack(buf, max_numel=1 << 128)
    lengths = tuple(map(len, (c.index_params, c.value_params, c.index_section, c.value_section, c.perm_section)))
    return (c.version, c.flags, c.index_id, c.value_id, c.perm_width, c.digest, c.n, lengths, c.shape)


@settings(max_examples=200, deadline=None)
@given(c=containers())
def test_pack_is_byte_identical_and_parses_alike(c):
    packed = native.pack(c.flags, c.index_id, c.value_id, c.perm_width, c.digest or bytes(8), c.n, c.shape,
                         c.index_params, c.value_params, c.index_section, c.value_section, c.perm_section)
    assert packed.tobytes() == python_pack(c).tobytes()
    assert container.pack(c).tobytes() == packed.tobytes()
    assert native.crc32(packed[:-4]) == zlib.crc32(packed[:-4].tobytes())
    assert parse(native.unpack_header, packed) == parse(python_header, packed)


@settings(max_examples=300, deadline=None)
@given(c=containers(), cut=st.integers(0, 200), flip=st.integers(0, 10_000), byte=st.integers(0, 255))
def test_damaged_buffers_fail_with_the_same_message(c, cut, flip, byte):
    buf = bytearray(python_pack(c).tobytes())
    if flip % 3 == 0:
        buf = buf[:max(0, len(buf) - cut)]
    elif buf:
        buf[flip % len(buf)] = byte
        if flip % 3 == 1:   # keep the CRC valid so the field checks behind it run
            buf[-4:] = zlib.crc32(bytes(buf[:-4])).to_bytes(4, "little")
    got, expected = parse(native.unpack_header, bytes(buf)), parse(python_header, bytes(buf))
    assert got == expected


@pytest.mark.parametrize("magic", [b"D'RD", b'D"RD', b"D'\"D", b"\\\x00\x7f\n"])
def test_bad_magic_is_quoted_as_python_quotes_it(magic):
    buf = magic + python_pack(container.Container(shape=(), n=0, index_id=0, value_id=0)).tobytes()[4:]
    assert parse(native.unpack_header, buf) == parse(python_header, buf)


def test_version_1_containers_parse_alike():
    import struct

    shape = (3, 5)
    body = struct.pack("<4sBBBBBBHHHQQQQ", b"DPRD", 1, 0, 0, 0, 2, 0, 0, 0, 0, 2, 8, 8, 0)
    body += struct.pack("<2Q", *shape) + bytes(range(16))
    buf = body + struct.pack("<I", zlib.crc32(body))
    assert parse(native.unpack_header, buf) == parse(python_header, buf)
    assert native.unpack_header(buf)[-1] == shape


@settings(max_examples=300, deadline=None)
@given(c=containers(), flip=st.integers(0, 10_000), byte=st.integers(0, 255),
       expected=st.one_of(st.none(), st.lists(st.integers(0, 40), max_size=3).map(tuple)),
       max_numel=st.sampled_from([1, 1000, 1 << 40]))
def test_unpack_with_receiver_bounds_names_the_same_first_problem(c, flip, byte, expected, max_numel):
    """container.unpack through the twin and through Python: same class and text (or header)."""
    buf = bytearray(python_pack(c).tobytes())
    buf[flip % len(buf)] = byte
    buf[-4:] = zlib.crc32(bytes(buf[:-4])).to_bytes(4, "little")

    def outcome():
        try:
            got = container.unpack(bytes(buf), expected, max_numel)
            return "ok", (got.shape, got.n, got.flags)
        except DeepReduceError as exc:
            return type(exc).__name__, str(exc)

    twin = outcome()
    with mock.patch.dict(os.environ, {"DEEPREDUCE_BACKEND": "numpy"}):
        assert outcome() == twin
