"""Value codecs: exact wire sizes, round trips, C++/NumPy identity, rejection of corrupt sections."""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from deepreduce import registry
from deepreduce.config import build
from deepreduce.errors import ContainerError, DeepReduceError
from deepreduce.values import polyfit as polyfit_mod
from deepreduce.wire import bitpack, container
from deepreduce.wire.seeding import EncodeContext

CTX = EncodeContext(b"\x00" * 16, "layer", 3)


def make_values(n, seed=0):
    rng = np.random.default_rng(seed)
    dense = rng.laplace(scale=1e-3, size=max(100 * n, 1000)).astype(np.float32)
    return dense[np.argsort(-np.abs(dense), kind="stable")[:n]].copy()


def codec(id_, **params):
    return registry.create("value", {"id": id_, **params})


# ---------------------------------------------------------------------------- wire sizes
@pytest.mark.parametrize("n", [0, 1, 511, 512, 513, 1500])
def test_qsgd_wire_size(n):
    enc = codec("qsgd").encode(make_values(n), CTX)
    assert len(enc.params) == 6
    assert len(enc.payload) == 4 * math.ceil(n / 512) + n          # 8 n + 32 ceil(n/512) bits
    wide = codec("qsgd", levels=1000, bucket_size=100).encode(make_values(n), CTX)
    assert len(wide.payload) == 4 * math.ceil(n / 100) + 2 * n


@pytest.mark.parametrize("free", [False, True])
@pytest.mark.parametrize("level", [0, 1, 6, 9])
def test_deflate_wire_size_is_the_zlib_stream(level, free):
    v = make_values(700)
    c = codec("deflate", level=level)
    c.reorder_is_free = free
    enc = c.encode(v, CTX)
    sent = v if enc.order is None else v[enc.order]
    assert enc.params == b"" and enc.payload == zlib.compress(sent.astype("<f4").tobytes(), level)


def test_deflate_sends_sorted_values_only_when_that_is_smaller_with_the_permutation():
    from deepreduce.values._sorting import sort_descending
    from deepreduce.values.deflate import permutation_bytes

    v = np.random.default_rng(2).laplace(scale=1e-3, size=20_000).astype(np.float32)
    plain = len(zlib.compress(v.tobytes(), 6))
    ordered = len(zlib.compress(v[sort_descending(v)].tobytes(), 6))
    assert ordered < plain < ordered + permutation_bytes(v.size)     # sorting pays only if free
    free = codec("deflate")
    free.reorder_is_free = True
    enc = free.encode(v, CTX)
    assert np.array_equal(enc.order, sort_descending(v)) and len(enc.payload) == ordered
    assert free.decode(enc.params, enc.payload, v.size).tobytes() == v[enc.order].tobytes()
    costly = codec("deflate")                       # a set index codec: the permutation travels
    enc = costly.encode(v, CTX)
    assert enc.order is None and len(enc.payload) == plain
    # 256 values drawn from 64 distinct ones: sorted runs compress so well that even a carried
    # 8-bit permutation pays
    rng = np.random.default_rng(3)
    steps = rng.standard_normal(64).astype(np.float32)[rng.integers(0, 64, size=256)]
    enc = costly.encode(steps, CTX)
    assert enc.order is not None
    assert len(enc.payload) + permutation_bytes(steps.size) < len(zlib.compress(steps.tobytes(), 6))


@pytest.mark.parametrize("index", ["raw", "elias_fano"])
def test_deflate_pipeline_round_trip_and_permutation_only_when_it_pays(index):
    grad = np.random.default_rng(4).laplace(scale=1e-3, size=200_000).astype(np.float32)
    cfg = {"sparsifier": {"id": "topk", "ratio": 0.05}, "index": {"id": index},
           "value": {"id": "deflate"}, "memory": {"id": "none"}}
    pipe = build(cfg)
    payload = pipe.encode(grad, "g", 0)
    c = container.unpack(payload)
    keep = pipe.sparsifier.select(grad, pipe.context("g", 0))
    expected = np.zeros_like(grad)
    expected[keep] = grad[keep]
    np.testing.assert_array_equal(build(cfg).decode(payload), expected)
    plain = len(zlib.compress(grad[keep].tobytes(), 6))
    if index == "raw":            # free reorder: the sorted stream (about half at 255,570 values)
        assert not c.permuted and len(c.value_section) < plain
    else:                                           # 14-bit permutation costs more than it saves
        assert not c.permuted and len(c.value_section) == plain


@pytest.mark.parametrize("n", [1, 4, 5, 368])
def test_dexp_wire_size(n):
    enc = codec("dexp").encode(make_values(n), CTX)
    assert enc.params == b""
    assert len(enc.payload) == (4 * n if n <= 4 else 16)


def polyfit_expected_size(lengths, degree, coef_bytes):
    return 4 + 4 * len(lengths) + coef_bytes * sum(min(degree, s - 1) + 1 for s in lengths)


@pytest.mark.parametrize("n,degree,segments,coef", [(0, 5, 4, "float32"), (3, 5, 4, "float32"),
                                                   (368, 5, 4, "float32"), (5000, 5, 4, "float64"),
                                                   (2000, 2, 8, "float32")])
def test_polyfit_wire_size(n, degree, segments, coef):
    c = codec("polyfit", degree=degree, segments=segments, coef_dtype=coef)
    enc = c.encode(make_values(n), CTX)
    assert enc.params == bytes([degree, c.coef_bytes])
    lengths, pos, _ = polyfit_mod.parse_lengths(enc.payload, n, degree)
    assert sum(lengths) == n and pos == 4 + 4 * len(lengths)
    assert len(enc.payload) == polyfit_expected_size(lengths, degree, c.coef_bytes)
    if n >= 5000:  # every segment full: the spec formula 32 + 32 n_seg + n_seg (n'+1) w_c bits
        assert len(lengths) == 2 * segments
        assert len(enc.payload) * 8 == 32 + 32 * len(lengths) + len(lengths) * (degree + 1) * 64


def test_sketchml_wire_size_without_sketch():
    v = make_values(1000)
    c = codec("sketchml", buckets=64, sketch=False)
    enc = c.encode(v, CTX)
    npos, nneg = int((v >= 0).sum()), int((v < 0).sum())
    part = lambda cnt: 2 + 4 * min(64, cnt) + bitpack.packed_size(cnt, bitpack.width_for(min(64, cnt) - 1))
    assert len(enc.params) == 8
    assert len(enc.payload) == math.ceil(1000 / 8) + part(npos) + part(nneg)


def test_sketchml_wire_size_with_sketch():
    v = make_values(1000)
    enc = codec("sketchml", buckets=128, rows=2, col_ratio=0.2).encode(v, CTX)
    npos, nneg = int((v >= 0).sum()), int((v < 0).sum())
    part = lambda cnt: 2 + 4 * 128 + 4 + bitpack.packed_size(2 * math.ceil(0.2 * cnt), 7)
    assert len(enc.payload) == math.ceil(1000 / 8) + part(npos) + part(nneg)


def test_fp16_and_raw_wire_sizes():
    v = make_values(300)
    assert len(codec("raw").encode(v, CTX).payload) == 1200
    assert len(codec("fp16").encode(v, CTX).payload) == 600


def test_container_size_adds_up_for_polyfit_with_raw_indices():
    grad = np.random.default_rng(1).laplace(size=(64, 64, 3, 3)).astype(np.float32)
    pipe = build({"sparsifier": {"id": "topk", "ratio": 0.01}, "index": {"id": "raw"},
                  "value": {"id": "polyfit"}, "memory": {"id": "none"}, "min_numel": 0})
    payload = pipe.encode(grad, "conv")
    c = container.unpack(payload)
    assert c.n == 368 and not c.permuted and len(c.index_section) == 4 * 368
    sections = len(c.index_section), len(c.value_section)
    assert payload.size == container.overhead(grad.shape, c.n, *sections, value_params=2) + sum(sections)


# ---------------------------------------------------------------------------- round trips
LOSSLESS = ["raw", "deflate"]


@pytest.mark.parametrize("id_", sorted(set(registry.ids("value"))))
@pytest.mark.parametrize("n", [0, 1, 2, 7, 368])
def test_round_trip_lengths_and_order(id_, n):
    c = codec(id_)
    v = make_values(n, seed=n)
    enc = c.encode(v, CTX)
    out = c.decode(enc.params, enc.payload, n)
    assert out.dtype == np.float32 and out.shape == (n,) and np.isfinite(out).all()
    if enc.order is not None:
        assert not c.keeps_order
        assert sorted(enc.order.tolist()) == list(range(n))
    if id_ in LOSSLESS:
        assert out.tobytes() == (v if enc.order is None else v[enc.order]).tobytes()
    if id_ in ("polyfit", "dexp") and 0 < n <= 4:   # exact: interpolation / verbatim values
        np.testing.assert_allclose(out, v[enc.order], rtol=1e-5, atol=1e-9)


def test_polyfit_backends_give_identical_bytes(monkeypatch):
    native = polyfit_mod._native.load("fit")
    if native is None:
        pytest.skip("C++ extension deepreduce._fit is not built")
    for n in (0, 1, 6, 21, 127, 128, 368, 1000, 1001, 4000, 9000):
        v = make_values(n, seed=n)
        v[: n // 10] = 0.0
        for degree, segments, min_points in ((5, 4, 20), (3, 8, 20), (0, 2, 20), (5, 0, 6), (5, 0, 1)):
            p1, b1 = native.encode(v, degree, segments, min_points, 4)
            p2, b2 = polyfit_mod.encode_numpy(v, degree, segments, min_points, 4)
            assert b1 == b2 and np.array_equal(p1, p2)
            d1 = native.decode(b1, n, degree, 4)
            d2 = polyfit_mod.decode_numpy(b1, n, degree, 4)
            assert d1.tobytes() == d2.tobytes()
    monkeypatch.setenv("DEEPREDUCE_BACKEND", "numpy")
    assert codec("polyfit").backend == "numpy"


@pytest.mark.parametrize("coef_bytes", [4, 8])
def test_polyfit_decode_of_every_degree_matches_numpy_bit_for_bit(coef_bytes):
    # The C++ decode evaluates each degree with its own unrolled (vectorised) loop.
    native = polyfit_mod._native.load("fit")
    if native is None:
        pytest.skip("C++ extension deepreduce._fit is not built")
    for degree in range(polyfit_mod.MAX_DEGREE + 1):
        for n in (1, 17, 203):
            v = make_values(n, seed=degree * 7 + n)
            _, payload = native.encode(v, degree, 3, degree + 1, coef_bytes)
            got = native.decode(payload, n, degree, coef_bytes)
            assert got.tobytes() == polyfit_mod.decode_numpy(payload, n, degree, coef_bytes).tobytes(), (degree, n)


def test_sort_matches_native_on_ties_and_signed_zeros():
    native = polyfit_mod._native.load("fit")
    if native is None:
        pytest.skip("C++ extension deepreduce._fit is not built")
    from deepreduce.values._sorting import sort_descending

    v = np.array([0.0, -0.0, 1.0, -1.0, 1.0, 0.0, -2.5, 3e-38, -3e-38, 1.0], dtype=np.float32)
    perm = sort_descending(v)
    assert np.array_equal(perm, native.sort_desc(v))
    assert perm.tolist() == [2, 4, 9, 7, 0, 5, 1, 8, 3, 6]


def test_fp16_refuses_overflow():
    with pytest.raises(DeepReduceError):
        codec("fp16").encode(np.array([1e6], dtype=np.float32), CTX)


# ---------------------------------------------------------------------------- corruption
def encoded(id_, n=368, **params):
    c = codec(id_, **params)
    enc = c.encode(make_values(n), CTX)
    return c, enc


@pytest.mark.parametrize("id_", sorted(set(registry.ids("value")) - {"raw", "fp16"}))
def test_truncated_or_extended_value_section_raises(id_):
    c, enc = encoded(id_)
    for bad in (enc.payload[:-1], enc.payload + b"\x00", b""):
        with pytest.raises(ContainerError):
            c.decode(enc.params, bad, 368)


@pytest.mark.parametrize("id_", sorted(set(registry.ids("value"))))
def test_random_corruption_never_escapes_deepreduce_error(id_):
    c, enc = encoded(id_, n=200)
    rng = np.random.default_rng(7)
    for _ in range(40):
        buf = bytearray(enc.payload)
        if not buf:
            break
        for pos in rng.integers(0, len(buf), size=3):
            buf[pos] = int(rng.integers(0, 256))
        try:
            out = c.decode(enc.params, bytes(buf), 200)
        except DeepReduceError:
            continue
        assert out.shape == (200,)
        if id_ not in ("raw", "fp16"):   # these carry arbitrary float bit patterns by design
            assert np.isfinite(out).all()


def test_structural_corruptions_are_named():
    c, enc = encoded("polyfit")
    bad = bytearray(enc.payload)
    bad[4:8] = (10 ** 6).to_bytes(4, "little")   # first segment longer than the positive part
    with pytest.raises(ContainerError, match="segment"):
        c.decode(enc.params, bytes(bad), 368)
    with pytest.raises(ContainerError, match="polyfit"):
        c.decode(enc.params, (1000).to_bytes(4, "little") + enc.payload[4:], 368)
    c, enc = encoded("qsgd", levels=10)
    bad = bytearray(enc.payload)
    bad[-1] = 100                                  # level 100 > 10
    with pytest.raises(ContainerError, match="level"):
        c.decode(enc.params, bytes(bad), 368)
    with pytest.raises(ContainerError):
        c.decode(enc.params[:-1], enc.payload, 368)
    c, enc = encoded("deflate")
    with pytest.raises(ContainerError, match="zlib"):
        c.decode(b"", b"\x00" * len(enc.payload), 368)
    c, enc = encoded("dexp")
    with pytest.raises(ContainerError, match="non-finite"):
        c.decode(b"", np.array([np.nan] * 4, "<f4").tobytes(), 368)
    c, enc = encoded("sketchml")
    with pytest.raises(ContainerError):
        c.decode(b"\xff" + enc.params[1:], enc.payload, 368)


def test_corrupt_value_section_in_a_container_raises():
    grad = np.random.default_rng(2).laplace(size=5000).astype(np.float32)
    for value in ("polyfit", "qsgd", "deflate", "dexp", "sketchml", "sketchml_huffman"):
        pipe = build({"sparsifier": {"id": "topk", "ratio": 0.05}, "index": {"id": "raw"},
                      "value": {"id": value}, "memory": {"id": "none"}, "min_numel": 0})
        c = container.unpack(pipe.encode(grad, "g"))
        c.value_section = c.value_section[:-2]           # re-packed: the CRC is valid again
        with pytest.raises(DeepReduceError):
            pipe.decode(container.pack(c))


def test_native_polyfit_decode_rejects_garbage_without_crashing():
    native = polyfit_mod._native.load("fit")
    if native is None:
        pytest.skip("C++ extension deepreduce._fit is not built")
    rng = np.random.default_rng(11)
    good = native.encode(make_values(300), 5, 4, 20, 4)[1]
    for trial in range(300):
        size = int(rng.integers(0, 80)) if trial % 2 else len(good)
        junk = bytes(rng.integers(0, 256, size=size, dtype=np.uint8))
        if trial % 3 == 0:
            junk = good[:8] + junk[8:]          # plausible header, garbage after it
        try:
            out = native.decode(junk, 300, 5, 4)
        except ValueError:
            continue
        assert out.shape == (300,) and np.isfinite(out).all()
    with pytest.raises(ValueError):
        native.decode(good, -1, 5, 4)
    with pytest.raises(ValueError):
        native.decode(good, 300, 16, 4)
    with pytest.raises(ValueError):
        native.encode(make_values(10), 5, -1, 20, 4)
