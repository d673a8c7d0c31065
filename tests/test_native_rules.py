"""Each wire rule has one C++ definition, which the Python core calls when the extensions are built;
the pure-Python fallbacks kept for installs without them must agree with it byte for byte and text
for text (seed derivation, Bloom and polyfit params, the polyfit decode checks, the thread limit)."""
import numpy as np
import pytest

from deepreduce import ContainerError, DeepReduceError
from deepreduce.backend import parallel
from deepreduce.index import bloom as bl
from deepreduce.values import polyfit as pf
from deepreduce.wire import seeding

_seeding = pytest.importorskip("deepreduce._seeding", reason="needs the C++ extensions (make setup)")
_bloom = pytest.importorskip("deepreduce._bloom", reason="needs the C++ extensions (make setup)")
_fit = pytest.importorskip("deepreduce._fit", reason="needs the C++ extensions (make setup)")
_select = pytest.importorskip("deepreduce._select", reason="needs the C++ extensions (make setup)")

DIGEST = bytes(range(16))


def outcome(call, *args):
    """The result of a call, or its error class and text."""
    try:
        return call(*args)
    except (ContainerError, DeepReduceError) as exc:
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("name, step, purpose", [
    ("", 0, ""), ("layer/kernel", 12345, "bloom-p1"), ("é" * 100, -5, "x" * 200), ("w", 2**63 - 1, "qsgd"),
    ("n" * 127, -(2**63), ""),   # messages across the 128-byte block boundary of BLAKE2b
])
def test_seed_derivation_is_one_rule(name, step, purpose):
    expected = seeding.derive_seed_python(DIGEST, name, step, purpose)
    assert _seeding.derive_seed(DIGEST, name, step, purpose) == expected
    assert seeding.derive_seed(DIGEST, name, step, purpose) == expected


@pytest.mark.parametrize("policy", bl.POLICIES)
def test_bloom_params_pack_and_unpack_as_the_fallback(policy):
    for k, blocks, seed, draw in [(1, 0, 0, 0), (9, 12, 5, 77), (64, bl.MAX_BLOCKS, 2**64 - 1, 2**64 - 1)]:
        packed = bl.pack_params_python(policy, k, blocks, seed, draw)
        assert _bloom.pack_params(policy, k, blocks, seed, draw) == packed
        assert bl.BloomParams(*_bloom.unpack_params(packed)) == bl.unpack_params_python(packed)


@pytest.mark.parametrize("params", [
    b"", b"\x10", b"\x27\x03", b"\x10\x00\x01\x00", b"\x10\x41\x01\x00", b"\x10\x03", b"\x10\x03\x01",
    b"\x12\x03\x01\x00\x00", b"\x11\x03\x01\x00\x00", b"\x11\x03\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",
    b"\x11\x03\x80\x00\x00", b"\x11\x03\xff\xff\xff\xff\x0f\x00", b"\x02\x03" + bytes(24), b"\x02\x03" + bytes(23),
    b"\x12\x03\x05\x07" + bytes(8),
])
def test_bloom_params_are_checked_with_the_same_text(params):
    try:
        native = bl.BloomParams(*_bloom.unpack_params(params))
    except ValueError as exc:
        native = ("ContainerError", str(exc))
    assert native == outcome(bl.unpack_params_python, params)


def test_bloom_block_count_is_one_rule():
    lam, _ = bl.filter_shape(0.001)
    for r in (0, 1, 2, 1000, 123_457, 10**9):
        assert _bloom.blocks_for(r, lam) == (0 if r == 0 else max(1, int(np.ceil(r / lam))))
    with pytest.raises(ValueError, match=r"Bloom filter for 10000000000000 indices needs \d+ blocks; at most"):
        _bloom.blocks_for(10**13, lam)


@pytest.mark.parametrize("params", [b"\x05\x04", b"\x0f\x08", b"\x00\x04", b"", b"\x05", b"\x10\x04", b"\x05\x02",
                                    b"\x05\x04\x00"])
def test_polyfit_params_as_the_fallback(params):
    try:
        native = _fit.unpack_params(params)
    except ValueError as exc:
        native = ("ContainerError", str(exc))
    assert native == outcome(pf.unpack_params_python, params)
    if not isinstance(native[0], str):
        assert _fit.pack_params(*native) == pf.pack_params_python(*native) == params


def _payloads():
    """Valid and corrupted polyfit payloads with the value count they claim."""
    values = np.random.default_rng(3).standard_normal(500).astype(np.float32)
    _, good = pf.encode_numpy(values, 5, 0, 6, 4)
    bad_coef = bytearray(good)
    bad_coef[-4:] = np.float32(np.inf).tobytes()
    huge = bytearray(good)
    huge[-4:] = np.float32(3e38).tobytes()
    return [(good, 500), (good, 499), (good[:3], 500), (good[:-1], 500), (bytes(bad_coef), 500),
            (bytes(huge), 500), (b"\x00\x00\x00\x00" + b"\xff\xff\xff\xff" * 2, 2**40),
            (b"\x05\x00\x00\x00", 4), (b"\x00\x00\x00\x00\x00\x00\x00\x00", 3)]


@pytest.mark.parametrize("case", range(len(_payloads())))
def test_polyfit_decode_checks_as_the_fallback(case):
    payload, count = _payloads()[case]

    def fallback():
        pf.parse_lengths(payload, count, 5)
        return pf.decode_numpy(payload, count, 5, 4)

    try:
        native = _fit.decode(payload, count, 5, 4)
    except ValueError as exc:
        native = ("ContainerError", str(exc))
    expected = outcome(fallback)
    if isinstance(expected, tuple):
        assert native == expected
    else:
        np.testing.assert_array_equal(native, expected)


def test_one_thread_limit():
    assert parallel.MAX_THREADS == _select.MAX_THREADS
