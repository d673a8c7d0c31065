"""The shared canonical Huffman code: paper vector, determinism, limits, corrupt streams."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepreduce.errors import ContainerError
from deepreduce.wire import huffman_code as hc


def test_paper_example():
    # DeepReduce App. 11.0.1: "aaaabaacaabaa" with code (a, b, c) -> (0, 10, 11) is 16 bits.
    symbols = np.array([0, 0, 0, 0, 1, 0, 0, 2, 0, 0, 1, 0, 0])
    lengths = hc.code_lengths(np.bincount(symbols))
    assert lengths.tolist() == [1, 2, 2] and hc.canonical_codes(lengths).tolist() == [0, 2, 3]
    data = hc.encode(symbols, lengths)
    assert format(int.from_bytes(data, "big"), "016b") == "0000100011001000"
    assert hc.decode(data, lengths, symbols.size).tolist() == symbols.tolist()


def test_ties_break_by_symbol_value():
    assert hc.code_lengths([5, 5, 5, 5]).tolist() == [2, 2, 2, 2]
    assert hc.code_lengths([1, 1, 2]).tolist() == [2, 2, 1]
    assert hc.code_lengths([0, 7, 0]).tolist() == [0, 1, 0]


def test_length_limit_is_respected():
    fib = [1, 1]
    while len(fib) < 40:
        fib.append(fib[-1] + fib[-2])
    lengths = hc.code_lengths(fib, max_length=12)
    assert lengths.max() <= 12
    kraft = sum(2.0 ** -int(l) for l in lengths)
    assert kraft == pytest.approx(1.0)
    symbols = np.arange(40)
    assert hc.decode(hc.encode(symbols, lengths), lengths, 40).tolist() == symbols.tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=0, max_size=300), st.integers(21, 60))
def test_round_trip(symbols, alphabet):
    symbols = np.array(symbols, dtype=np.int64)
    lengths = hc.code_lengths(np.bincount(symbols, minlength=alphabet))
    table = hc.pack_lengths(lengths)
    back, end = hc.unpack_lengths(table)
    assert end == len(table) and back.tolist() == lengths.tolist()
    data = hc.encode(symbols, lengths)
    assert hc.decode(data, back, symbols.size).tolist() == symbols.tolist()


def test_corrupt_streams_raise():
    symbols = np.random.default_rng(0).integers(0, 9, size=500)
    lengths = hc.code_lengths(np.bincount(symbols))
    data = hc.encode(symbols, lengths)
    for bad in (data[:-1], data + b"\x00", b""):
        with pytest.raises(ContainerError):
            hc.decode(bad, lengths, symbols.size)
    over = lengths.copy()
    over[0] = 1
    over[1] = 1
    with pytest.raises(ContainerError, match="prefix code"):
        hc.decode(data, over, symbols.size)
    with pytest.raises(ContainerError):
        hc.unpack_lengths(hc.pack_lengths(lengths)[:-1])
    one = hc.code_lengths([0, 3])
    with pytest.raises(ContainerError):
        hc.decode(b"\x01", one, 3)
