"""Chunk-local index codecs (``chunk_fixed``, ``chunk_enum``): round trips of chunked Top-k sets
and of any other set, the exact section sizes, and refusal of hostile sections."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import deepreduce
from deepreduce.errors import ContainerError
from deepreduce.index import chunk_enum
from deepreduce.registry import create
from deepreduce.sparsify.chunked import chunk_topk_positions
from deepreduce.wire import bitpack, chunks, container, varint
from deepreduce.wire.seeding import EncodeContext

CTX = EncodeContext(b"\x03" * 16, "t", 0)
CODECS = ("chunk_fixed", "chunk_enum")


def encode(codec_id, positions, numel, chunk=4096):
    codec = create("index", {"id": codec_id, "chunk": chunk})
    dense = np.arange(numel, dtype=np.float32)
    positions = np.asarray(positions, dtype=np.int64)
    return codec, codec.encode(positions, dense[positions], dense, CTX)


def expected_section_bytes(codec_id, numel, chunk, counts, uniform):
    """The documented section size: counts (when not uniform) then the chunks' codes."""
    c = min(chunk, numel)
    lengths = chunks.chunk_lengths(numel, c)
    head = 0 if uniform else bitpack.packed_size(lengths.shape[0], bitpack.width_for(c))
    if codec_id == "chunk_fixed":
        return head + bitpack.packed_size(int(counts.sum()), bitpack.width_for(c - 1))
    bits = sum(chunk_enum.enum_bits(int(L), int(h)) for L, h in zip(lengths, counts))
    return head + (bits + 7) // 8


@pytest.mark.parametrize("codec_id", CODECS)
@pytest.mark.parametrize("numel,chunk,k", [(4096 * 8, 4096, 64), (4096 * 8 + 333, 4096, 32), (1500, 4096, 64),
                                           (64 * 64 + 5, 64, 1), (100, 10, 10), (4096 * 3, 4096, 4000)])
def test_chunk_topk_sets_round_trip_at_the_documented_size(codec_id, numel, chunk, k):
    flat = np.random.default_rng(numel).laplace(size=numel).astype(np.float32)
    positions = chunk_topk_positions(flat, chunk, k)
    codec, enc = encode(codec_id, positions, numel, chunk)
    c = min(chunk, numel)
    counts = chunks.counts_of(positions, numel, c)
    assert enc.params == varint.encode(c) + varint.encode(chunks.uniform_k(counts, numel, c))
    assert chunks.uniform_k(counts, numel, c) > 0                 # the geometry travels, not the counts
    for L, h in zip(chunks.chunk_lengths(numel, c), counts):     # each chunk at its information limit
        assert chunk_enum.enum_bits(int(L), int(h)) == (math.comb(int(L), int(h)) - 1).bit_length()
    assert len(enc.payload) == expected_section_bytes(codec_id, numel, chunk, counts, True)
    np.testing.assert_array_equal(create("index", codec_id).decode(enc.params, enc.payload, len(positions), numel),
                                  positions)


def test_bits_per_index_of_the_frontier_settings():
    """12 bits (SparseLoCo's packing) against the information limit, which chunk_enum reaches to
    within a bit per chunk: 7.36 -> 7.375 bits (64 of 4096), 8.32 -> 8.344 (32 of 4096)."""
    numel = 4096 * 64
    flat = np.random.default_rng(0).standard_normal(numel).astype(np.float32)
    for k, fixed_bits, enum_bits in ((64, 12.0, 7.375), (32, 12.0, 8.34375)):
        positions = chunk_topk_positions(flat, 4096, k)
        for codec_id, bits in (("chunk_fixed", fixed_bits), ("chunk_enum", enum_bits)):
            _, enc = encode(codec_id, positions, numel)
            assert 8 * len(enc.payload) / len(positions) == pytest.approx(bits)
        limit = math.log2(math.comb(4096, k)) / k
        assert limit < enum_bits < limit + 1 / k + 8 / len(positions)


@pytest.mark.parametrize("codec_id", CODECS)
def test_other_sets_travel_with_their_counts(codec_id):
    rng = np.random.default_rng(2)
    numel = 4096 * 5 + 77
    for positions in (np.sort(rng.choice(numel, 700, replace=False)),     # a Top-r: uneven counts
                      np.arange(4096, 8192),                               # one chunk full, others empty
                      np.array([numel - 1]), np.arange(numel)):
        codec, enc = encode(codec_id, positions, numel)
        counts = chunks.counts_of(positions, numel, 4096)
        assert enc.params == varint.encode(4096) + varint.encode(chunks.uniform_k(counts, numel, 4096))
        assert len(enc.payload) == expected_section_bytes(codec_id, numel, 4096, counts,
                                                          chunks.uniform_k(counts, numel, 4096) > 0)
        np.testing.assert_array_equal(codec.decode(enc.params, enc.payload, len(positions), numel), positions)


def test_enum_fallback_for_dense_chunks_of_long_chunks():
    """A chunk whose ranking table would be too large goes as a bitmap or fixed offsets, whichever
    is smaller; either way it round-trips."""
    numel, chunk = 1 << 16, 1 << 16
    rng = np.random.default_rng(4)
    for count, mode in ((5, chunk_enum.ENUM), (1000, chunk_enum.FIXED), (30000, chunk_enum.BITMAP)):
        assert chunk_enum.layout(chunk, count)[0] == mode
        positions = np.sort(rng.choice(numel, count, replace=False))
        codec, enc = encode("chunk_enum", positions, numel, chunk)
        assert len(enc.payload) == (chunk_enum.enum_bits(chunk, count) + 7) // 8
        np.testing.assert_array_equal(codec.decode(enc.params, enc.payload, count, numel), positions)


@pytest.mark.parametrize("codec_id", CODECS)
def test_empty_set(codec_id):
    codec, enc = encode(codec_id, [], 5000)
    assert enc.params == b"" and enc.payload == b""
    assert codec.decode(b"", b"", 0, 5000).shape == (0,)
    with pytest.raises(ContainerError, match="expected none"):
        codec.decode(b"", b"\x00", 0, 5000)


def _uniform_case(codec_id):
    numel = 4096 * 3 + 100
    flat = np.random.default_rng(5).standard_normal(numel).astype(np.float32)
    positions = chunk_topk_positions(flat, 4096, 32)
    codec, enc = encode(codec_id, positions, numel)
    return codec, enc, positions, numel


@pytest.mark.parametrize("codec_id", CODECS)
def test_hostile_sections_are_refused(codec_id):
    codec, enc, positions, numel = _uniform_case(codec_id)
    n, params, payload = len(positions), enc.params, enc.payload
    cases = {
        "truncated": (params, payload[:-1], n, numel),
        "extended": (params, payload + b"\x00", n, numel),
        "wrong count": (params, payload, n - 1, numel),
        "wrong numel": (params, payload, n, numel + 4096),
        "trailing params": (params + b"\x00", payload, n, numel),
        "no k": (params[:2], payload, n, numel),
        "chunk zero": (varint.encode(0) + varint.encode(32), payload, n, numel),
        "chunk too long": (varint.encode(chunks.MAX_CHUNK + 1) + varint.encode(32), payload, n, numel),
        "chunk longer than tensor": (varint.encode(numel + 1) + varint.encode(1), payload, 1, numel),
        "k above chunk": (varint.encode(4096) + varint.encode(4097), payload, n, numel),
        "counted but no counts": (varint.encode(4096) + varint.encode(0), payload, n, numel),
    }
    for what, args in cases.items():
        with pytest.raises(ContainerError):
            codec.decode(*args)
            pytest.fail(f"{codec_id} accepted a section with {what}")


def test_fixed_offsets_beyond_the_tail_or_repeated_are_refused():
    numel = 4096 + 100                                  # a tail of 100 keeps ceil(32 * 100 / 4096) = 1
    codec = create("index", "chunk_fixed")
    params = varint.encode(4096) + varint.encode(32)
    good = list(range(32)) + [99]
    assert codec.decode(params, bytes(bitpack.pack(np.array(good, np.uint64), 12)), 33, numel)[-1] == 4096 + 99
    for bad, match in ((list(range(32)) + [100], "beyond its chunk"),
                       ([0] + list(range(31)) + [5], "repeats"),
                       (list(range(31, -1, -1)) + [5], "repeats")):
        with pytest.raises(ContainerError, match=match):
            codec.decode(params, bytes(bitpack.pack(np.array(bad, np.uint64), 12)), 33, numel)
    section = bytearray(bitpack.pack(np.array(good, np.uint64), 12))
    section[-1] |= 0xF0                                   # 33 * 12 bits end mid-byte: padding set
    with pytest.raises(ContainerError, match="padding"):
        codec.decode(params, bytes(section), 33, numel)


def test_enum_rank_beyond_the_binomial_is_refused():
    numel, k = 4096, 2
    codec = create("index", "chunk_enum")
    params = varint.encode(4096) + varint.encode(k)
    bits = (math.comb(4096, 2) - 1).bit_length()
    top = (1 << bits) - 1                                  # >= C(4096, 2): no subset has this rank
    assert top >= math.comb(4096, 2)
    with pytest.raises(ContainerError, match="rank"):
        codec.decode(params, top.to_bytes((bits + 7) // 8, "little"), k, numel)
    last = math.comb(4096, 2) - 1                          # the largest rank: the two last offsets
    np.testing.assert_array_equal(codec.decode(params, last.to_bytes((bits + 7) // 8, "little"), k, numel),
                                  [4094, 4095])


@pytest.mark.parametrize("codec_id", CODECS)
def test_counts_that_overfill_a_chunk_or_miss_the_total_are_refused(codec_id):
    numel = 4096 + 10
    codec = create("index", codec_id)
    params = varint.encode(4096) + varint.encode(0)
    width = bitpack.width_for(4096)
    for counts, n, match in (([0, 11], 11, "more indices in a chunk"), ([3, 2], 4, "sum to")):
        head = bytes(bitpack.pack(np.array(counts, np.uint64), width))
        with pytest.raises(ContainerError, match=match):
            codec.decode(params, head + b"\x00" * 64, n, numel)


@pytest.mark.parametrize("config", ["sparseloco", "semisync_topk"])
def test_every_flipped_byte_of_a_container_is_refused(config):
    pipe = deepreduce.build(f"configs/{config}.yaml")
    grad = np.random.default_rng(6).standard_normal(4096 * 2 + 50).astype(np.float32)
    payload = pipe.encode(grad, "w", 0)
    c = container.unpack(payload)
    codec = create("index", pipe.index.id)
    section = bytes(c.index_section)
    for i in range(len(section)):
        bad = bytearray(section)
        bad[i] ^= 0xFF
        try:
            out = codec.decode(c.index_params, bytes(bad), c.n, 4096 * 2 + 50)
        except ContainerError:
            continue
        # accepted: it must be a valid set of the same geometry (a different one: the CRC guards)
        assert np.array_equal(chunks.counts_of(out, 4096 * 2 + 50, 4096),
                              chunks.uniform_counts(4096 * 2 + 50, 4096, 64))
        assert np.all(np.diff(out) > 0)


@settings(max_examples=80, deadline=None)
@given(numel=st.integers(1, 6000), chunk=st.integers(1, 700), density=st.floats(0.0, 1.0), seed=st.integers(0, 2**16),
       codec_id=st.sampled_from(CODECS))
def test_any_set_round_trips(numel, chunk, density, seed, codec_id):
    rng = np.random.default_rng(seed)
    positions = np.flatnonzero(rng.random(numel) < density)
    codec, enc = encode(codec_id, positions, numel, chunk)
    np.testing.assert_array_equal(create("index", codec_id).decode(enc.params, enc.payload, len(positions), numel),
                                  positions)
    np.testing.assert_array_equal(enc.indices, positions)


def test_binomial_tables_are_shared_by_shorter_chunks():
    """C(c, i) does not depend on the chunk length: the full chunks' table serves every tail, so a
    model whose tensors have many different tail lengths builds it once (the Python definition's
    tables; the C++ section keeps its own)."""
    chunk_enum._TABLES.clear()   # a larger table built by an earlier test would serve both
    full = chunk_enum._tables(4096, 64)
    assert chunk_enum._tables(1000, 16) is full
    assert chunk_enum._tables(4096, 64)[0][3][10] == math.comb(10, 3)


def test_config_refuses_different_chunks_for_sparsifier_and_index():
    from deepreduce.errors import ConfigError
    base = {"sparsifier": {"id": "chunk_topk", "chunk": 2048}, "value": "raw", "memory": "none"}
    for index in CODECS:
        with pytest.raises(ConfigError, match="same chunk"):
            deepreduce.build(dict(base, index={"id": index, "chunk": 4096}))
        assert deepreduce.build(dict(base, index={"id": index, "chunk": 2048})).index.chunk == 2048
    assert deepreduce.build({"sparsifier": {"id": "topk"}, "index": "chunk_enum", "value": "raw",
                             "memory": "none"}).index.chunk == 4096        # any other sparsifier: counts travel


@pytest.mark.parametrize("length,count", [(1024, 32), (64, 40), (1100, 550)])
def test_unrank_inverts_rank_for_every_chunk_at_once(length, count):
    """The vectorised greedy unranking against the ranks, many chunks at once: a float64 first
    guess (1024 choose 32), the complement's ranks (40 of 64), and ranks past a float's range
    (1100 choose 550, over 1,000 bits: exact integers only)."""
    rng = np.random.default_rng(length + count)
    offsets = np.sort(np.stack([rng.choice(length, count, replace=False) for _ in range(200)]), axis=1)
    offsets[0], offsets[1] = np.arange(count), np.arange(length - count, length)   # the first and last rank
    ranked = chunk_enum.layout(length, count)[2]
    try:
        ranks = chunk_enum._ranks(offsets, length, ranked)
        assert ranks[0] == 0 or ranked != count
        np.testing.assert_array_equal(chunk_enum._unrank(ranks, length, count, ranked), offsets)
    finally:
        chunk_enum._TABLES.clear()   # the 1,100-element table is large: not kept for later tests
