"""Bloom filter index codec: both hash families, C++/NumPy identity, threads, policies, sizing
against the measured false-positive rate, corruption and argument checks of deepreduce._bloom."""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deepreduce
from deepreduce.backend import _native
from deepreduce.errors import ContainerError, DeepReduceError
from deepreduce.index import bloom as bl
from deepreduce.wire import container, varint
from deepreduce.wire.seeding import EncodeContext

NATIVE = _native.load("bloom")
needs_native = pytest.mark.skipif(NATIVE is None, reason="C++ extension deepreduce._bloom not built")
SELECTING = ("p1", "p2", "leftmost", "middle", "rightmost")


def ctx(step=0, name="t"):
    return EncodeContext(b"\x01" * 16, name, step)


def sparse_case(d, r, seed):
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal(d).astype(np.float32)
    idx = np.sort(rng.choice(d, r, replace=False)).astype(np.int64)
    return dense, idx


def encode_decode(policy, dense, idx, fpr=0.01, step=0, backend=None, monkeypatch=None, threads=1):
    if backend == "numpy":
        monkeypatch.setenv("DEEPREDUCE_BACKEND", "numpy")
    codec = bl.BloomIndex(policy=policy, fpr=fpr)
    codec.threads = threads
    enc = codec.encode(idx, dense[idx], dense, ctx(step))
    receiver = bl.BloomIndex()  # defaults: everything needed travels in the params
    receiver.threads = threads
    dec = receiver.decode(enc.params, enc.payload, len(enc.indices), dense.size)
    return codec, enc, dec


# ------------------------------------------------------------------------------ sizing
@pytest.mark.parametrize("fpr", [0.6, 0.1, 0.01, 0.001, 1e-6])
def test_filter_params_meet_the_rate_with_the_fewest_blocks(fpr):
    lam, k = bl._keys_per_block(fpr)
    assert bl.blocked_fpr(lam, k) <= fpr < bl.blocked_fpr(lam * 1.001, k)
    for other in (k - 1, k + 1):   # no other k lets more indices share a block
        if 1 <= other <= bl.MAX_K:
            assert bl.blocked_fpr(lam, other) > fpr
    for r in (1, 46, 10_000, 255_570):
        blocks, kk = bl.filter_params(r, fpr)
        assert kk == k and blocks == max(1, math.ceil(r / lam))
        assert bl.theoretical_fpr(blocks, k, r) <= fpr
    assert bl.filter_params(0, fpr) == (0, k)
    # blocking costs bits: more than an unblocked filter, within the documented margin
    unblocked = math.log2(1 / fpr) / math.log(2)
    assert unblocked <= bl.BLOCK_BITS / lam <= unblocked * (1.4 if fpr < 1e-3 else 1.09)


def test_blocked_rate_formula_reduces_to_the_textbook_cases():
    # one member per block, k = 1: the chance that one probe hits its one set bit
    assert bl.blocked_fpr(1e-9, 1) == pytest.approx(1e-9 / bl.BLOCK_BITS, rel=1e-3)
    # an overloaded block answers yes to almost everything
    assert bl.blocked_fpr(5000, 3) > 0.99


@pytest.mark.parametrize("fpr", [0.1, 0.01])
def test_false_positives_match_the_formula(fpr):
    d, r = 400_000, 4_000
    counts = []
    for seed in range(4):
        dense, idx = sparse_case(d, r, 200 + seed)
        codec = bl.BloomIndex(policy="p0", fpr=fpr, hash_seed=seed)
        P = codec.encode(idx, dense[idx], dense, ctx()).indices
        assert np.isin(idx, P).all()   # no false negatives
        counts.append(P.size - r)
    blocks, k = bl.filter_params(r, fpr)
    eps = bl.theoretical_fpr(blocks, k, r)
    # Counts vary more between filters than a binomial would (each filter's fill differs), so
    # compare the mean over filters with a relative margin: the formula is exact to a few
    # percent, on the high side (Poisson block loads spread more than binomial ones).
    measured = float(np.mean(counts)) / (d - r)
    assert 0.95 * eps < measured < 1.03 * eps
    assert eps <= fpr


def test_reference_bloom_filter_and_ours_track_their_theory():
    pybloomfilter = pytest.importorskip("pybloomfilter")
    d, r, fpr = 200_000, 2_000, 0.01
    rng = np.random.default_rng(11)
    members = rng.choice(d, r, replace=False)
    others = np.setdiff1d(np.arange(d), members)
    ref = pybloomfilter.BloomFilter(r, fpr)
    ref.update(str(int(i)) for i in members)
    ref_fp = sum(str(int(i)) in ref for i in others)
    ref_eps = (1.0 - math.exp(-ref.num_hashes * r / ref.num_bits)) ** ref.num_hashes
    dense = np.ones(d, dtype=np.float32)
    idx = np.sort(members).astype(np.int64)
    our_fp = bl.BloomIndex(policy="p0", fpr=fpr).encode(idx, dense[idx], dense, ctx()).indices.size - r
    our_eps = bl.theoretical_fpr(*bl.filter_params(r, fpr), r)
    n = others.size
    for fp, eps in [(ref_fp, ref_eps), (our_fp, our_eps)]:
        assert abs(fp - eps * n) < 5 * math.sqrt(eps * (1 - eps) * n) + 1, (fp, eps * n)


# ------------------------------------------------------------------------------ hash families
def test_mulhi64_exact():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 2**64 - 1, 500, dtype=np.uint64, endpoint=True)
    for b in [1, 7, 2**32 - 1, 2**32, 2**32 + 7, 2**63 + 5, 2**64 - 1]:
        expect = [(int(x) * b) >> 64 for x in a]
        assert bl.mulhi64(a, b).tolist() == expect


def test_hash_families_reference_values():
    # Pin both families: a change here breaks wire compatibility.
    assert bl.hash_key(0, 0) == 0xE220A8397B1DCDAF  # first SplitMix64 output for seed 0
    got = bl.splitmix_positions(np.array([0, 1, 2**40], dtype=np.uint64), 1000, 2, 0).tolist()
    assert got == [[281, 802], [652, 276], [677, 179]]
    assert bl.blocked_key(0) == 0xE220A8397B1DCDAF
    x = np.array([0, 1, 2**40, 2**64 - 1], dtype=np.uint64)
    assert bl.blocked_positions(x, 1000, 3, 0).tolist() == [
        _blocked_ref(int(v), 1000, 3, 0) for v in x]


def _blocked_ref(x, blocks, k, seed):
    """The blocked family written out on Python ints, straight from docs/bloom.md."""
    h = bl.mix64_int(bl.blocked_key(seed) + x * bl.GAMMA)
    block = ((h >> 32) * blocks) >> 32
    g = h & 0xFFFFFFFF
    out = []
    for _ in range(k):
        out.append(512 * block + (g >> 23))
        g = (g * 0x5BD1E995) & 0xFFFFFFFF
    return out



def test_blocked_positions_stay_in_one_block_and_use_only_64_bit_products():
    pos = bl.blocked_positions(np.arange(10_000, dtype=np.uint64), bl.MAX_BLOCKS, 9, 5)
    assert (pos // 512 == pos[:, :1] // 512).all() and pos.max() < bl.MAX_BLOCKS * 512
    # (h >> 32) * blocks < 2**63 and g * 0x5bd1e995 < 2**63: int64 tensor ops compute the same
    assert (2**32 - 1) * bl.MAX_BLOCKS < 2**63 and (2**32 - 1) * bl.PROBE_MUL < 2**63


@needs_native
@pytest.mark.parametrize("family,size", [("blocked", 1), ("blocked", 777), ("blocked", bl.MAX_BLOCKS),
                                         ("splitmix", 13), ("splitmix", 2**32 + 9), ("splitmix", 2**64 - 1)])
def test_hash_families_identical_in_cpp_and_numpy(family, size):
    x = np.concatenate([np.arange(50), np.random.default_rng(0).integers(0, 2**64 - 1, 200, dtype=np.uint64)])
    x = x.astype(np.uint64)
    assert np.array_equal(NATIVE.positions(x, size, 11, 12345, family), bl.positions(x, size, 11, 12345, family))


def _splitmix_filter(idx, m, k, seed):
    bits = np.zeros(m, dtype=bool)
    bits[bl.splitmix_positions(idx, m, k, seed).ravel().astype(np.int64)] = True
    return np.packbits(bits, bitorder="little").tobytes()


@needs_native
def test_v1_splitmix_filters_still_query_and_select_alike():
    d, idx = 60_000, np.sort(np.random.default_rng(4).choice(60_000, 600, replace=False)).astype(np.uint64)
    m, k = 5_753, 7
    bits = _splitmix_filter(idx, m, k, 3)
    P = bl.np_query(bits, m, k, 3, d, d, "splitmix")
    for threads in (1, 3):
        assert np.array_equal(NATIVE.query(bits, m, k, 3, d, d, threads, "splitmix"), P)
    assert np.isin(idx, P).all()
    assert np.array_equal(NATIVE.select_conflict(P, 600, m, k, 3, 9, "splitmix"),
                          bl.np_select_conflict(P, 600, m, k, 3, 9, "splitmix"))
    # and the codec decodes a v1 (splitmix) params block with them
    params = bl._SPLITMIX_PARAMS.pack(bl._POLICY_CODE["p2"], k, m, 3, 9)
    dec = bl.BloomIndex().decode(params, bits, 600, d)
    assert np.array_equal(dec, bl.np_select_conflict(P, 600, m, k, 3, 9, "splitmix").astype(np.int64))


# ------------------------------------------------------------------------------ C++ == NumPy, threads
@needs_native
@pytest.mark.parametrize("policy", bl.POLICIES)
def test_cpp_and_numpy_paths_give_same_bytes_and_choices(policy, monkeypatch):
    dense, idx = sparse_case(60_000, 600, seed=5)
    codec, enc_c, dec_c = encode_decode(policy, dense, idx, step=3)
    assert codec.backend == "c++"
    codec_n, enc_n, dec_n = encode_decode(policy, dense, idx, step=3, backend="numpy", monkeypatch=monkeypatch)
    assert codec_n.backend == "numpy"
    assert enc_c.params == enc_n.params and enc_c.payload == enc_n.payload
    assert np.array_equal(enc_c.indices, enc_n.indices) and np.array_equal(enc_c.values, enc_n.values)
    assert np.array_equal(dec_c, dec_n)


@needs_native
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(bl.POLICIES), d=st.integers(1, 40_000), ratio=st.floats(0.0, 0.2),
       fpr=st.sampled_from([0.5, 0.05, 0.001]), seed=st.integers(0, 2**64 - 1), step=st.integers(0, 2**40))
def test_property_cpp_and_numpy_give_the_same_bytes(policy, d, ratio, fpr, seed, step):
    rng = np.random.default_rng(seed % 2**32)
    dense = rng.standard_normal(d).astype(np.float32)
    idx = np.sort(rng.choice(d, int(d * ratio), replace=False)).astype(np.int64)
    out = []
    for backend in ("c++", "numpy"):
        with pytest.MonkeyPatch.context() as mp:
            if backend == "numpy":
                mp.setenv("DEEPREDUCE_BACKEND", "numpy")
            codec = bl.BloomIndex(policy=policy, fpr=fpr, hash_seed=seed)
            enc = codec.encode(idx, dense[idx], dense, ctx(step))
            dec = bl.BloomIndex().decode(enc.params, enc.payload, len(enc.indices), d)
            assert codec.backend == backend
            out.append((enc.params, enc.payload, enc.indices.tolist(), dec.tolist()))
    assert out[0] == out[1]
    assert out[0][2] == out[0][3]


@needs_native
@pytest.mark.parametrize("fpr", [0.01, 0.001])
def test_dense_filters_query_alike(fpr):
    # Half the positions are members (fig11's recommender gradients): most candidates survive the
    # first two probes, and the kernel tests the remaining ones at once.
    d = 50_000
    idx = np.sort(np.random.default_rng(8).choice(d, d // 2, replace=False)).astype(np.uint64)
    blocks, k = bl.filter_params(idx.size, fpr)
    assert k > 2
    bits = NATIVE.build(idx, blocks, k, 9, 1)
    P = NATIVE.query(bits, blocks, k, 9, d, d, 1)
    assert np.array_equal(P, bl.np_query(bits, blocks, k, 9, d, d)) and np.isin(idx, P).all()
    for limit in (0, 999, d // 2):
        assert np.array_equal(NATIVE.query(bits, blocks, k, 9, d, limit, 1), P[:limit + 1])


@needs_native
@settings(max_examples=150, deadline=None)
@given(blocks=st.integers(1, 40), k=st.integers(1, 64), d=st.integers(0, 3_000), fill=st.floats(0.0, 1.0),
       seed=st.integers(0, 2**64 - 1), limit=st.integers(0, 3_000), threads=st.integers(1, 3), data=st.data())
def test_property_simd_and_portable_query_alike(blocks, k, d, fill, seed, limit, threads, data):
    # Arbitrary filter bytes (a hostile container's, or a filter of any fill), k up to 64 (probes
    # that wrap g many times), d not a multiple of the 8 lanes: the AVX2 code, the portable loop
    # and the NumPy reference find the same positives, cut at limit + 1 alike.
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    bits = np.packbits(rng.random(512 * blocks) < fill, bitorder="little").tobytes()
    simd = NATIVE.query(bits, blocks, k, seed, d, limit, threads)
    portable = NATIVE.query(bits, blocks, k, seed, d, limit, threads, simd=False)
    assert np.array_equal(simd, portable)
    assert np.array_equal(simd, bl.np_query(bits, blocks, k, seed, d, limit))


@needs_native
def test_simd_query_of_a_large_filter_matches_the_portable_loop():
    # Above 256 KiB the AVX2 code prefetches each block's line before probing it.
    d = 1_000_000
    idx = np.sort(np.random.default_rng(5).choice(d, 200_000, replace=False)).astype(np.uint64)
    blocks, k = bl.filter_params(idx.size, 0.0001)
    assert blocks * 64 > 256 << 10
    bits = NATIVE.build(idx, blocks, k, 2, 1)
    P = NATIVE.query(bits, blocks, k, 2, d, d, 1)
    assert np.isin(idx, P).all() and np.array_equal(P, NATIVE.query(bits, blocks, k, 2, d, d, 1, simd=False))


@needs_native
def test_thread_count_never_changes_a_byte():
    d = 700_000   # large enough for 7 threads of at least 65,536 positions
    dense, idx = sparse_case(d, 7_000, seed=6)
    blocks, k = bl.filter_params(idx.size, 0.01)
    ref_bits = NATIVE.build(idx.astype(np.uint64), blocks, k, 4, 1)
    assert ref_bits == bl.np_build(idx.astype(np.uint64), blocks, k, 4)
    ref_P = NATIVE.query(ref_bits, blocks, k, 4, d, d, 1)
    for threads in (2, 3, 7):
        assert NATIVE.build(idx.astype(np.uint64), blocks, k, 4, threads) == ref_bits
        assert np.array_equal(NATIVE.query(ref_bits, blocks, k, 4, d, d, threads), ref_P)
        for limit in (0, 100, 7_000, ref_P.size - 1, ref_P.size):   # early stop: first limit + 1
            got = NATIVE.query(ref_bits, blocks, k, 4, d, limit, threads)
            assert np.array_equal(got, ref_P[:limit + 1])
    for policy in ("p0", "p2"):
        results = [encode_decode(policy, dense, idx, step=1, threads=t)[1:] for t in (1, 2, 3, 7)]
        for enc, dec in results[1:]:
            assert enc.payload == results[0][0].payload and enc.params == results[0][0].params
            assert np.array_equal(dec, results[0][1])


# ------------------------------------------------------------------------------ policies
@pytest.mark.parametrize("policy", SELECTING + ("naive",))
@pytest.mark.parametrize("seed", [0, 1])
def test_selecting_policies_send_exactly_r_and_receiver_agrees(policy, seed):
    dense, idx = sparse_case(40_000, 400, seed)
    _, enc, dec = encode_decode(policy, dense, idx, fpr=0.05, step=seed)
    assert len(enc.indices) == 400 == len(dec) == len(np.unique(dec))
    assert np.array_equal(enc.indices, dec)
    assert np.all(np.diff(dec) > 0)
    if policy != "naive":
        assert np.array_equal(enc.values, dense[dec])  # values from the dense gradient
    else:
        assert np.array_equal(enc.values, dense[idx])  # the sparse values, shifted onto P[:r]


def test_deterministic_windows():
    dense, idx = sparse_case(40_000, 400, 2)
    codec = bl.BloomIndex(policy="p0", fpr=0.05)
    P = codec.encode(idx, dense[idx], dense, ctx()).indices
    for policy, window in [("leftmost", P[:400]), ("rightmost", P[-400:]),
                           ("middle", P[(P.size - 400) // 2:(P.size - 400) // 2 + 400])]:
        assert np.array_equal(encode_decode(policy, dense, idx, fpr=0.05)[1].indices, window)


def test_p1_p2_depend_on_step_and_tensor():
    dense, idx = sparse_case(40_000, 400, 4)
    for policy in ("p1", "p2"):
        a = bl.BloomIndex(policy=policy, fpr=0.05).encode(idx, dense[idx], dense, ctx(0)).indices
        b = bl.BloomIndex(policy=policy, fpr=0.05).encode(idx, dense[idx], dense, ctx(1)).indices
        c = bl.BloomIndex(policy=policy, fpr=0.05).encode(idx, dense[idx], dense, ctx(0, "other")).indices
        assert not np.array_equal(a, b) and not np.array_equal(a, c)


def test_p0_reproduces_inherently_sparse_gradient_exactly():
    rng = np.random.default_rng(7)
    grad = np.zeros((300, 200), dtype=np.float32)
    nz = rng.choice(grad.size, 2500, replace=False)
    grad.ravel()[nz] = rng.standard_normal(2500).astype(np.float32)
    pipe = deepreduce.build({"sparsifier": {"id": "none"}, "index": {"id": "bloom", "policy": "p0", "fpr": 0.6},
                             "value": {"id": "raw"}, "memory": {"id": "none"}})
    out = pipe.decode(pipe.encode(grad, name="emb", step=1))
    assert np.array_equal(out, grad)


def test_p0_is_exact_on_positives_for_topk():
    dense, idx = sparse_case(50_000, 500, 8)
    _, enc, dec = encode_decode("p0", dense, idx, fpr=0.01)
    assert set(idx.tolist()) <= set(dec.tolist())
    assert np.array_equal(enc.values, dense[dec])


def test_p2_keeps_more_true_positives_than_p1():
    wins, tp1, tp2 = 0, 0, 0
    for seed in range(20):
        dense, idx = sparse_case(20_000, 200, 100 + seed)
        a = encode_decode("p1", dense, idx, fpr=0.05, step=seed)[1].indices
        b = encode_decode("p2", dense, idx, fpr=0.05, step=seed)[1].indices
        n1, n2 = np.intersect1d(a, idx).size, np.intersect1d(b, idx).size
        tp1, tp2, wins = tp1 + n1, tp2 + n2, wins + (n2 > n1)
    assert tp2 > tp1 and wins >= 18


# ------------------------------------------------------------------------------ wire
@pytest.mark.parametrize("policy", ["p0", "p2"])
@pytest.mark.parametrize("r", [0, 1, 777])
def test_wire_size_is_whole_blocks(policy, r):
    dense, idx = sparse_case(30_000, r, 9)
    codec = bl.BloomIndex(policy=policy, fpr=0.001, hash_seed=300)
    enc = codec.encode(idx, dense[idx], dense, ctx())
    blocks, k = bl.filter_params(r, 0.001)
    assert len(enc.payload) == 64 * blocks
    assert len(enc.params) == 2 + varint.size(blocks) + varint.size(300) + (8 if policy == "p2" else 0)
    assert bl.unpack_params(enc.params) == bl.BloomParams("blocked", policy, k, blocks, 300,
                                                          enc_draw(enc) if policy == "p2" else 0)
    assert len(enc.indices) >= r and (policy == "p0" or len(enc.indices) == r)


def enc_draw(enc):
    return bl.unpack_params(enc.params).draw_seed


def test_describe_params_names_both_families():
    params = bl.pack_params("p1", 9, 12, 5, 77)
    assert bl.BloomIndex.describe_params(params) == {"family": "blocked", "policy": "p1", "k": 9, "blocks": 12,
                                                     "m": 12 * 512, "hash_seed": 5, "draw_seed": 77}
    v1 = bl._SPLITMIX_PARAMS.pack(3, 7, 1000, 1, 2)
    assert bl.BloomIndex.describe_params(v1) == {"family": "splitmix", "policy": "p2", "k": 7, "m": 1000,
                                                 "hash_seed": 1, "draw_seed": 2}


def _pipeline(policy):
    return deepreduce.build({"sparsifier": {"id": "topk", "ratio": 0.01},
                             "index": {"id": "bloom", "policy": policy, "fpr": 0.01},
                             "value": {"id": "raw"}, "memory": {"id": "none"}})


@pytest.mark.parametrize("policy", ["p0", "p1", "p2", "leftmost"])
def test_corrupted_index_section_raises(policy):
    pipe = _pipeline(policy)
    grad = np.random.default_rng(1).standard_normal(20_000).astype(np.float32)
    c = container.unpack(pipe.encode(grad, name="w", step=0))
    rng = np.random.default_rng(2)
    cases = [c.index_section[:-1], c.index_section + b"\x00", b"\xff" * len(c.index_section),
             b"\x00" * len(c.index_section)]
    for _ in range(5):
        buf = bytearray(c.index_section)
        buf[int(rng.integers(len(buf)))] ^= 0xFF
        cases.append(bytes(buf))
    for bad in cases:
        c.index_section = bad
        try:
            out = pipe.decode(container.pack(c))
        except DeepReduceError:
            continue
        assert out.shape == grad.shape  # a flip can yield another valid filter; never a crash


@pytest.mark.parametrize("params", [
    b"", b"\x11", b"\x21\x05\x01\x00",               # too short, unknown family
    b"\x17\x05\x01\x00", b"\x11\x00\x01\x00", b"\x11\x41\x01\x00",   # unknown policy, k = 0, k = 65
    b"\x11\x05\x01\x00\x00",                         # a byte after the last field
    b"\x13\x05\x01\x00\x01\x02",                     # p2 without its 8-byte draw seed
    b"\x11\x05\x80\x80\x80\x80\x08\x00",             # 2**31 blocks
    b"\x11\x05\x81\x00\x00",                         # varint not in its shortest form
    b"\x11\x05\x02\x00",                             # 2 blocks, the section holds 1 or more
    b"\x01\x05" + (2**63).to_bytes(8, "little") + b"\x00" * 16,   # v1 params, m = 2**63
    b"\x01\x05" + (2**64 - 1).to_bytes(8, "little") + b"\x00" * 16,
])
def test_corrupted_params_raise(params):
    pipe = _pipeline("p0")
    grad = np.random.default_rng(1).standard_normal(20_000).astype(np.float32)
    c = container.unpack(pipe.encode(grad, name="w", step=0))
    c.index_params = params
    with pytest.raises(ContainerError):
        pipe.decode(container.pack(c))


def test_huge_index_uses_64_bit_positions():
    idx = np.array([0, 5, 2**33 + 1, 2**40 - 1, 2**64 - 1], dtype=np.uint64)
    blocks, k = bl.filter_params(idx.size, 0.01)
    payload = bl.np_build(idx, blocks, k, 0)
    pos = bl.blocked_positions(idx, blocks, k, 0)
    bits = np.unpackbits(np.frombuffer(payload, np.uint8), bitorder="little")
    assert bits[pos.astype(np.int64)].all()
    if NATIVE is not None:
        assert NATIVE.build(idx, blocks, k, 0) == payload


# ------------------------------------------------------------------------------ argument checks
GOOD_BITS = bytes(64 * 4)


@needs_native
@pytest.mark.parametrize("call,error,message", [
    (lambda: NATIVE.build(np.array([1, 2, 3], np.uint64), 2**64 - 1, 3, 0), ValueError, "blocks"),
    (lambda: NATIVE.build(np.array([1, 2, 3], np.uint64), 2**31, 3, 0), ValueError, "blocks"),
    (lambda: NATIVE.build(np.array([1, 2, 3], np.uint64), 0, 3, 0), ValueError, "blocks must be positive"),
    (lambda: NATIVE.build(np.array([1, 2, 3], np.uint64), 4, 0, 0), ValueError, "k = 0"),
    (lambda: NATIVE.build(np.array([1, 2, 3], np.uint64), 4, 65, 0), ValueError, "k = 65"),
    (lambda: NATIVE.build(np.array([1.5, 2.0]), 4, 3, 0), TypeError, "integer array"),
    (lambda: NATIVE.build(np.array([True]), 4, 3, 0), TypeError, "integer array"),
    (lambda: NATIVE.build(np.array([-1], np.int64), 4, 3, 0), ValueError, "non-negative"),
    (lambda: NATIVE.build(np.zeros((2, 2), np.uint64), 4, 3, 0), ValueError, "1-D"),
    (lambda: NATIVE.build(np.array([1], np.uint64), 4, 3, 2**64), ValueError, "seed"),
    (lambda: NATIVE.build(np.array([1], np.uint64), 4, 3, -1), ValueError, "seed"),
    (lambda: NATIVE.build(np.array([1], np.uint64), 4.0, 3, 0), TypeError, "blocks must be an integer"),
    (lambda: NATIVE.build(np.array([1], np.uint64), 4, 3, 0, 0), ValueError, "threads"),
    (lambda: NATIVE.build(np.array([1], np.uint64), 4, 3, 0, 10**6), ValueError, "threads"),
    (lambda: NATIVE.build("abc", 4, 3, 0), TypeError, "integer array"),
    (lambda: NATIVE.query(GOOD_BITS[:-1], 4, 3, 0, 100, 100), ValueError, "bytes, expected"),
    (lambda: NATIVE.query(GOOD_BITS, 2**64 - 1, 3, 0, 100, 100, 1, "splitmix"), ValueError, "bytes, expected"),
    (lambda: NATIVE.query(GOOD_BITS, 2**64, 3, 0, 100, 100, 1, "splitmix"), ValueError, "m = "),
    (lambda: NATIVE.query(GOOD_BITS, 4, 3, 0, -5, 100), ValueError, "d = -5"),
    (lambda: NATIVE.query(GOOD_BITS, 4, 3, 0, 100, 2**64), ValueError, "limit"),
    (lambda: NATIVE.query(GOOD_BITS, 4, 3, 0, 100, 100, 1, "cuckoo"), ValueError, "family"),
    (lambda: NATIVE.positions(np.array([1], np.uint64), 0, 3, 0, "splitmix"), ValueError, "m must be positive"),
    (lambda: NATIVE.positions(np.array([1.0]), 5, 3, 0, "blocked"), TypeError, "integer array"),
    (lambda: NATIVE.select_random(np.array([1, 2], np.uint64), 3, 0), ValueError, "r = 3"),
    (lambda: NATIVE.select_random(np.array([2, 1], np.uint64), 1, 0), ValueError, "ascending"),
    (lambda: NATIVE.select_random(np.array([1.0, 2.0]), 1, 0), TypeError, "integer array"),
    (lambda: NATIVE.select_conflict(np.array([1, 2], np.uint64), 3, 4, 3, 0, 0), ValueError, "r = 3"),
    (lambda: NATIVE.select_conflict(np.array([1, 1], np.uint64), 1, 4, 3, 0, 0), ValueError, "ascending"),
    (lambda: NATIVE.select_conflict(np.array([1, 2], np.uint64), 1, 0, 3, 0, 0), ValueError, "empty filter"),
    (lambda: NATIVE.select_conflict(np.array([1, 2], np.uint64), 1, 2**64 - 7, 3, 0, 0, "splitmix"), None, None),
    (lambda: NATIVE.select_conflict(np.array([1, 2], np.uint64), 1, 2**31, 3, 0, 0), ValueError, "blocks"),
    (lambda: NATIVE.select_conflict(np.array([1, 2], np.uint64), 1, 4, 99, 0, 0), ValueError, "k = 99"),
])
def test_cpp_entry_points_check_their_arguments(call, error, message):
    if error is None:   # a valid call near the limits runs (m near 2**64 is a legal v1 size)
        assert call().size == 1
        return
    with pytest.raises(error, match=message):
        call()


def test_codec_turns_kernel_argument_errors_into_deepreduce_errors():
    codec = bl.BloomIndex()
    # a v1 filter whose m is near 2**64: its section can never have the bytes m implies
    params = bl._SPLITMIX_PARAMS.pack(1, 3, 2**64 - 1, 0, 0)
    with pytest.raises(ContainerError, match="bytes, expected"):
        codec.decode(params, bytes(8), 1, 100)
    with pytest.raises(ContainerError, match="bytes, expected"):
        codec.decode(bl.pack_params("p0", 3, bl.MAX_BLOCKS, 0, 0), bytes(64), 1, 100)
