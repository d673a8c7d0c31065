"""Lossless index codecs: rle, huffman, delta, delta_huffman, elias_fano."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import deepreduce
from deepreduce.errors import DeepReduceError
from deepreduce.index import delta, elias_fano, huffman, rle
from deepreduce.wire import container, huffman_code
from deepreduce.wire.seeding import EncodeContext

CODECS = {"rle": rle.RunLengthIndex, "huffman": huffman.HuffmanIndex, "delta": delta.DeltaIndex,
          "delta_huffman": delta.DeltaHuffmanIndex, "elias_fano": elias_fano.EliasFanoIndex}
CTX = EncodeContext(b"\x02" * 16, "t", 0)


def roundtrip(name, idx, d):
    dense = np.arange(d, dtype=np.float32)
    codec = CODECS[name]()
    enc = codec.encode(idx, dense[idx], dense, CTX)
    out = CODECS[name]().decode(enc.params, enc.payload, len(idx), d)
    return enc, out


@st.composite
def index_sets(draw):
    d = draw(st.integers(1, 5000))
    kind = draw(st.sampled_from(["random", "empty", "full", "single", "ends", "runs"]))
    if kind == "empty":
        idx = []
    elif kind == "full":
        idx = list(range(d))
    elif kind == "single":
        idx = [draw(st.integers(0, d - 1))]
    elif kind == "ends":
        idx = sorted({0, d - 1})
    elif kind == "runs":
        start = draw(st.integers(0, d - 1))
        idx = list(range(start, min(d, start + draw(st.integers(1, 300)))))
    else:
        idx = sorted(draw(st.sets(st.integers(0, d - 1), max_size=min(d, 400))))
    return np.array(idx, dtype=np.int64), d


@pytest.mark.parametrize("name", sorted(CODECS))
@settings(max_examples=60, deadline=None)
@given(case=index_sets())
def test_lossless_roundtrip(name, case):
    idx, d = case
    enc, out = roundtrip(name, idx, d)
    assert np.array_equal(out, idx)
    assert np.array_equal(enc.indices, idx)


def test_huffman_keeps_order():
    idx = np.array([17, 3, 999, 0], dtype=np.int64)
    assert np.array_equal(roundtrip("huffman", idx, 1000)[1], idx)


def test_rle_paper_vector_and_size():
    # "aaaabaa" -> (4, a), (1, b), (2, a): a bitmap 0000100
    assert rle.runs_of(np.array([4]), 7).tolist() == [4, 1, 2]
    assert rle.runs_of(np.array([0, 1]), 3).tolist() == [0, 2, 1]
    assert rle.runs_of(np.array([1, 2]), 3).tolist() == [1, 2]
    rng = np.random.default_rng(0)
    idx = np.sort(rng.choice(10_000, 300, replace=False))
    enc, _ = roundtrip("rle", idx, 10_000)
    assert len(enc.payload) == math.ceil(rle.wire_bits(idx, 10_000) / 8)
    runs = rle.runs_of(idx, 10_000)
    assert rle.wire_bits(idx, 10_000) == 40 + runs.size * int(runs.max()).bit_length()


def test_huffman_paper_vector():
    # "aaaabaacaabaa" with the code (a, b, c) -> (0, 10, 11): 0000100011001000
    symbols = np.array(["abc".index(ch) for ch in "aaaabaacaabaa"])
    lengths = huffman_code.code_lengths(np.bincount(symbols))
    assert lengths.tolist() == [1, 2, 2]
    assert huffman_code.encode(symbols, lengths) == bytes([0b00001000, 0b11001000])


def test_huffman_static_code_counts_and_size():
    counts = huffman.byte_counts(70_000)
    assert sum(int(c) for c in counts) == 4 * 70_000
    brute = np.bincount(np.arange(70_000, dtype="<u4").view(np.uint8), minlength=256)
    assert [int(c) for c in counts] == brute.tolist()
    idx = np.sort(np.random.default_rng(1).choice(70_000, 700, replace=False))
    enc, _ = roundtrip("huffman", idx, 70_000)
    assert len(enc.payload) == math.ceil(huffman.wire_bits(idx, 70_000) / 8)
    assert huffman.wire_bits(idx, 70_000) < 32 * 700  # small indices: leading zero bytes are cheap


def test_delta_size_and_flags():
    idx = np.array([5, 300, 300 + 70_000, 300 + 70_000 + 2**24 + 1], dtype=np.int64)
    gaps, flags = delta.gaps_and_flags(idx)
    assert flags.tolist() == [0, 1, 2, 3]
    enc, out = roundtrip("delta", idx, 2**26)
    assert len(enc.payload) == delta.delta_wire_bytes(idx) == 4 + 1 + (1 + 2 + 3 + 4)
    enc_h, _ = roundtrip("delta_huffman", idx, 2**26)
    code_bits = int(np.sum(huffman_code.code_lengths(np.bincount(flags, minlength=4))[flags]))
    assert len(enc_h.payload) == 4 + math.ceil(code_bits / 8) + (1 + 2 + 3 + 4)


def test_delta_bytes_per_key_on_dense_set():
    idx = np.sort(np.random.default_rng(2).choice(1_000_000, 100_000, replace=False))  # 10% density
    enc, _ = roundtrip("delta", idx, 1_000_000)
    assert 1.25 <= len(enc.payload) / idx.size < 1.3  # SketchML: about 1.25 bytes/key at 10% sparsity
    enc_h, _ = roundtrip("delta_huffman", idx, 1_000_000)
    assert len(enc_h.payload) < len(enc.payload)


@pytest.mark.parametrize("d,r", [(1 << 20, 10_485), (36_864, 368), (25_557_032, 255_570), (1000, 1000), (1000, 1)])
def test_elias_fano_within_bound(d, r):
    idx = np.sort(np.random.default_rng(3).choice(d, r, replace=False))
    enc, out = roundtrip("elias_fano", idx, d)
    assert np.array_equal(out, idx)
    bits = elias_fano.stream_bits(r, d)
    assert len(enc.payload) == math.ceil(bits / 8)
    assert bits <= r * (2 + math.ceil(math.log2(d / r)))
    assert bits >= elias_fano.information_bits(r, d)


def _pipeline(name):
    return deepreduce.build({"sparsifier": {"id": "topk", "ratio": 0.02}, "index": {"id": name},
                             "value": {"id": "raw"}, "memory": {"id": "none"}})


@pytest.mark.parametrize("name", sorted(CODECS))
def test_corrupted_section_raises(name):
    pipe = _pipeline(name)
    grad = np.random.default_rng(4).standard_normal(30_000).astype(np.float32)
    c = container.unpack(pipe.encode(grad, name="w"))
    good = c.index_section
    rng = np.random.default_rng(5)
    cases = [good[:-1], good + b"\x00", b"\xff" * len(good), b"", good[: len(good) // 2]]
    for _ in range(20):
        buf = bytearray(good)
        buf[int(rng.integers(len(buf)))] ^= 1 << int(rng.integers(8))
        cases.append(bytes(buf))
    raised = 0
    for bad in cases:
        c.index_section = bad
        try:
            out = pipe.decode(container.pack(c))
        except DeepReduceError:
            raised += 1
            continue
        assert out.shape == grad.shape  # some flips give another valid set; never a crash
    assert raised >= 5


@pytest.mark.parametrize("name", ["huffman", "delta_huffman"])
def test_corrupted_params_raise(name):
    pipe = _pipeline(name)
    grad = np.random.default_rng(4).standard_normal(30_000).astype(np.float32)
    c = container.unpack(pipe.encode(grad, name="w"))
    for bad in [b"", b"\x00" * 9, b"\xff"]:
        c.index_params = bad
        with pytest.raises(DeepReduceError):
            pipe.decode(container.pack(c))
