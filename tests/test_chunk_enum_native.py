"""The C++ ``chunk_enum`` section (deepreduce._chunk_enum) against its Python definition: the same
bytes for every geometry and mode (enumerated, complemented, bitmap and fixed fallbacks, tails,
empty and full chunks), the same offsets on any number of threads, and the same refusal, text
for text, of every section no encoder writes."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepreduce.errors import ContainerError
from deepreduce.index import chunk_enum
from deepreduce.registry import create
from deepreduce.sparsify.chunked import chunk_topk_positions
from deepreduce.wire import chunks

native = pytest.importorskip("deepreduce._chunk_enum", reason="needs the C++ extensions (make setup)")
ENTRIES = chunk_enum.TABLE_ENTRIES


def outcome(call, *args):
    """What a call returns, or its error's text (ValueError from C++, ContainerError from Python)."""
    try:
        result = call(*args)
    except (ValueError, ContainerError) as exc:
        return ("refused", str(exc))
    return ("offsets", np.asarray(result).tolist()) if isinstance(result, np.ndarray) else ("bytes", result)


def random_set(rng, lengths, counts):
    parts = [np.sort(rng.choice(int(L), int(h), replace=False)) for L, h in zip(lengths, counts)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


@st.composite
def geometries(draw):
    """Chunks of one length (the last one possibly shorter) with counts anywhere in [0, L]:
    enumerated, complemented (more than half full), and, for long chunks, the fallbacks."""
    length = draw(st.sampled_from([1, 2, 3, 5, 64, 100, 1024, 4096, 70_000, 1 << 20]))
    chunk_count = draw(st.integers(1, 4))
    lengths = np.full(chunk_count, length, np.int64)
    lengths[-1] = draw(st.integers(1, length))
    dense = length <= 4096
    counts = np.array([draw(st.integers(0, int(L) if dense else min(int(L), 40))) for L in lengths], np.int64)
    if not dense and draw(st.booleans()):   # a long chunk past the table bound: bitmap or fixed offsets
        counts[0] = min(int(lengths[0]), draw(st.sampled_from([1, 2, 3, int(lengths[0]) // 16, int(lengths[0]) - 1])))
    return lengths, counts, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=150, deadline=None)
@given(geometries())
def test_same_bytes_and_offsets_as_the_definition(geometry):
    lengths, counts, seed = geometry
    local = random_set(np.random.default_rng(seed), lengths, counts)
    section = chunk_enum.pack_chunks_python(local, counts, lengths)
    for threads in (1, 3):
        assert native.pack(local, counts, lengths, ENTRIES, threads) == section
        assert np.array_equal(native.unpack(section, counts, lengths, ENTRIES, threads), local)
    for L, h in zip(lengths, counts):
        assert tuple(native.layout(int(L), int(h), ENTRIES)) == chunk_enum.layout(int(L), int(h))


def test_every_mode_is_exercised():
    """The geometries above reach each of the three modes (else the equality proves less)."""
    assert chunk_enum.layout(1024, 32)[0] == chunk_enum.ENUM
    assert chunk_enum.layout(1024, 1000)[2] == 24                     # complemented
    assert chunk_enum.layout(1 << 20, (1 << 20) // 16)[0] == chunk_enum.BITMAP
    assert chunk_enum.layout(1 << 20, 3)[0] == chunk_enum.FIXED


@pytest.mark.parametrize("numel, chunk, k", [(1 << 20, 1024, 32), ((1 << 18) + 77, 4096, 64), (300_000, 4096, 3000),
                                           ((1 << 22) + 5, 1024, 32)])   # up to 8 parts, 206 bits a chunk
def test_chunk_topk_selections_through_the_codec(numel, chunk, k):
    """The codec (native when built) writes the definition's section and reads its own back, with
    and without threads, for the frontier settings and a tail chunk."""
    x = np.random.default_rng(numel).standard_normal(numel).astype(np.float32)
    positions = np.sort(chunk_topk_positions(x, chunk, k)).astype(np.int64)
    counts = chunks.counts_of(positions, numel, chunk)
    lengths = chunks.chunk_lengths(numel, chunk)
    local = positions - np.repeat(np.arange(counts.shape[0], dtype=np.int64) * chunk, counts)
    codec = create("index", {"id": "chunk_enum", "chunk": chunk})
    section = chunk_enum.pack_chunks_python(local, counts, lengths)
    for threads in (1, 2, 7, 8):   # whole chunks per thread, each part's bytes ORed in: the same section
        codec.threads = threads
        assert codec.pack_chunks(local, counts, lengths) == section
        assert np.array_equal(codec.unpack_chunks(section, counts, lengths), local)


def hostile_cases():
    """(section, counts, lengths) that no encoder writes, each refused by one of the checks."""
    rng = np.random.default_rng(5)
    lengths, counts = np.full(6, 1024, np.int64), np.full(6, 32, np.int64)
    good = chunk_enum.pack_chunks_python(random_set(rng, lengths, counts), counts, lengths)
    bits = chunk_enum.enum_bits(1024, 32)
    cases = [(good[:-1], counts, lengths), (good + b"\x00", counts, lengths)]
    padded = bytearray(good)
    padded[-1] |= 0x80   # 6 x 206 bits leave 2 bits of padding
    cases.append((bytes(padded), counts, lengths))
    for chunk in (0, 3, 5):   # a rank past C(1024, 32): the chunk's field all ones
        stream = np.unpackbits(np.frombuffer(good, np.uint8), bitorder="little")
        stream[chunk * bits:(chunk + 1) * bits] = 1
        cases.append((np.packbits(stream, bitorder="little").tobytes(), counts, lengths))
    small = (np.array([5], np.int64), np.array([2], np.int64))   # C(5, 2) = 10 in 4 bits: ranks 10 ... 15
    cases += [(bytes([rank]), small[1], small[0]) for rank in range(16)]
    big = 1 << 20   # bitmaps of a 2^20-element chunk holding 2^16: one bit more, one less
    bitmap_counts, bitmap_lengths = np.array([big // 16, 3], np.int64), np.array([big, 7], np.int64)
    local = random_set(rng, bitmap_lengths, bitmap_counts)
    section = bytearray(chunk_enum.pack_chunks_python(local, bitmap_counts, bitmap_lengths))
    for flip in (int(local[0]), int(local[0]) + 1 if local[1] != local[0] + 1 else int(local[0]) + 2):
        hostile = bytearray(section)
        hostile[flip // 8] ^= 1 << (flip % 8)
        cases.append((bytes(hostile), bitmap_counts, bitmap_lengths))
    return cases


@pytest.mark.parametrize("case", range(len(hostile_cases())))
def test_hostile_sections_get_the_definitions_outcome(case):
    section, counts, lengths = hostile_cases()[case]
    expected = outcome(chunk_enum.unpack_chunks_python, section, counts, lengths)
    for threads in (1, 4):
        assert outcome(native.unpack, section, counts, lengths, ENTRIES, threads) == expected


def test_the_first_bad_chunk_in_the_stream_is_reported_on_any_thread_count():
    """Two bad chunks of different kinds, the enumerated one first: its text, on 1 to 8 threads
    (the chunks split over threads, the first failure in stream order wins)."""
    lengths = np.array([5] * 40000 + [1 << 20], np.int64)
    counts = np.array([2] * 40000 + [1 << 16], np.int64)
    rng = np.random.default_rng(9)
    local = random_set(rng, lengths, counts)
    stream = np.unpackbits(np.frombuffer(chunk_enum.pack_chunks_python(local, counts, lengths), np.uint8),
                           bitorder="little")
    stream[4 * 30000:4 * 30001] = 1              # chunk 30,000's rank is 15 >= C(5, 2)
    stream[4 * 40000 + int(local[-1])] ^= 1      # the bitmap loses one index
    section = np.packbits(stream, bitorder="little").tobytes()
    expected = outcome(chunk_enum.unpack_chunks_python, section, counts, lengths)
    assert expected == ("refused", "chunk_enum rank of a chunk exceeds C(5, 2)")
    for threads in (1, 2, 8):
        assert outcome(native.unpack, section, counts, lengths, ENTRIES, threads) == expected


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([(5, 2), (64, 3), (1024, 32), (4096, 64), (100, 90)]), st.integers(1, 3), st.data())
def test_random_sections_decode_or_are_refused_alike(shape, chunk_count, data):
    """Any bytes of the right length: both give the same offsets or the same refusal."""
    length, count = shape
    lengths, counts = np.full(chunk_count, length, np.int64), np.full(chunk_count, count, np.int64)
    size = (chunk_enum.enum_bits(length, count) * chunk_count + 7) // 8
    section = data.draw(st.binary(min_size=size, max_size=size))
    assert outcome(native.unpack, section, counts, lengths, ENTRIES, 2) == \
        outcome(chunk_enum.unpack_chunks_python, section, counts, lengths)


def test_ranks_beyond_a_double_are_exact():
    """Chunks whose binomials pass 2^1000 (no double guesses: the exact search alone) and ranks
    near both ends of [0, C(L, h))."""
    length, count = 2048, 256
    assert math.comb(length, count).bit_length() > 1000
    lengths, counts = np.full(3, length, np.int64), np.full(3, count, np.int64)
    rng = np.random.default_rng(1)
    local = np.concatenate([np.arange(count), np.arange(length - count, length), np.sort(rng.choice(length, count,
                                                                                                      replace=False))])
    section = native.pack(local, counts, lengths, ENTRIES)
    assert section == chunk_enum.pack_chunks_python(local, counts, lengths)
    assert np.array_equal(native.unpack(section, counts, lengths, ENTRIES, 2), local)


@pytest.mark.parametrize("local, counts, lengths", [
    ([0, 0], [2], [8]), ([3, 9], [2], [8]), ([5, 2], [2], [8]), ([-1, 2], [2], [8]),
    ([0, 1, 2, 3, 3, 5], [3, 3], [8, 8]), ([1, 2] + [0, 7] * 3, [2, 2, 2, 2], [8, 8, 8, 7]),
])
def test_offsets_that_are_not_a_set_are_refused_alike(local, counts, lengths):
    """A repeated, descending or out-of-chunk offset (a selection that is not a set) is refused by
    both backends with the same text, naming the first such chunk, before a byte is written."""
    args = (np.asarray(local, np.int64), np.asarray(counts, np.int64), np.asarray(lengths, np.int64))
    expected = outcome(chunk_enum.pack_chunks_python, *args)
    assert expected[0] == "refused" and "not ascending within" in expected[1]
    for threads in (1, 3):
        assert outcome(native.pack, *args, ENTRIES, threads) == expected


@pytest.mark.parametrize("local, counts, lengths, text", [
    ([1], [2], [8], "1 offsets for counts summing to 2"),
    ([1, 2, 3], [3], [2], "cannot hold 3 indices"),
    ([], [0], [0], "cannot hold 0 indices"),
])
def test_arguments_that_are_not_one_set_are_refused(local, counts, lengths, text):
    with pytest.raises(ValueError, match=text):
        native.pack(np.asarray(local, np.int64), np.asarray(counts, np.int64), np.asarray(lengths, np.int64), ENTRIES)


def test_threads_outside_the_bound_are_refused():
    with pytest.raises(ValueError, match="threads = 0 is outside"):
        native.unpack(b"", np.zeros(1, np.int64), np.ones(1, np.int64), ENTRIES, 0)
