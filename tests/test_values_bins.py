"""The b-bit bin value codecs: ``uniform`` (+-kappa RMS, SparseLoCo's 2-bit values) and
``binmean`` (per-message bins decoded as their means)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepreduce.errors import ConfigError, ContainerError
from deepreduce.registry import create
from deepreduce.wire import bitpack
from deepreduce.wire.seeding import EncodeContext

CTX = EncodeContext(b"\x04" * 16, "t", 0)


def section_bytes(codec_id, bits, n):
    """The documented value section size."""
    table = 4 if codec_id == "uniform" else 4 << bits
    return table + bitpack.packed_size(n, bits)


@pytest.mark.parametrize("codec_id", ["uniform", "binmean"])
@pytest.mark.parametrize("bits", [1, 2, 3, 8])
@pytest.mark.parametrize("n", [0, 1, 3, 1000])
def test_round_trip_size_and_reconstruction(codec_id, bits, n):
    values = np.random.default_rng(n + bits).laplace(size=n).astype(np.float32)
    codec = create("value", {"id": codec_id, "bits": bits})
    enc = codec.encode(values, CTX)
    assert enc.params == bytes([bits])
    assert len(enc.payload) == section_bytes(codec_id, bits, n)
    out = create("value", codec_id).decode(enc.params, enc.payload, n)
    assert out.dtype == np.float32 and out.shape == (n,)
    np.testing.assert_array_equal(out, enc.reconstructed)
    assert len(np.unique(out)) <= 1 << bits


def test_uniform_is_four_bins_over_three_sigma():
    values = np.array([-10.0, -1.0, -0.2, 0.2, 1.0, 10.0], np.float32)
    enc = create("value", {"id": "uniform", "bits": 2}).encode(values, CTX)
    scale = float(np.float32(3.0 * np.sqrt(np.mean(values.astype(np.float64) ** 2))))
    assert np.frombuffer(enc.payload[:4], "<f4")[0] == np.float32(scale)
    w = 2 * scale / 4
    expected = np.array([-scale + w / 2, -scale + 1.5 * w, -scale + 1.5 * w, -scale + 2.5 * w, -scale + 2.5 * w,
                         -scale + 3.5 * w], np.float32)
    np.testing.assert_allclose(enc.reconstructed, expected, rtol=1e-6)
    zeros = create("value", {"id": "uniform"}).encode(np.zeros(5, np.float32), CTX)
    np.testing.assert_array_equal(zeros.reconstructed, np.zeros(5))


def test_binmean_keeps_every_bin_sum_and_beats_uniform_at_two_bits():
    rng = np.random.default_rng(0)
    values = rng.standard_t(3, size=20000).astype(np.float32)    # heavy tails, as real gradients
    binmean = create("value", {"id": "binmean", "bits": 2}).encode(values, CTX)
    uniform = create("value", {"id": "uniform", "bits": 2}).encode(values, CTX)
    assert abs(float(binmean.reconstructed.sum(dtype=np.float64)) - float(values.sum(dtype=np.float64))) \
        < 1e-5 * float(np.abs(values).sum())
    err = {name: np.linalg.norm(e.reconstructed - values) for name, e in (("binmean", binmean), ("uniform", uniform))}
    assert err["binmean"] < 0.95 * err["uniform"]
    plain = create("value", {"id": "binmean", "bits": 2, "iterations": 0}).encode(values, CTX)
    assert err["binmean"] < np.linalg.norm(plain.reconstructed - values)    # the Lloyd steps help


def test_binmean_quantile_start_has_equal_counts():
    values = np.arange(12, dtype=np.float32)[::-1].copy()
    enc = create("value", {"id": "binmean", "bits": 2, "iterations": 0}).encode(values, CTX)
    np.testing.assert_array_equal(enc.reconstructed, [10, 10, 10, 7, 7, 7, 4, 4, 4, 1, 1, 1])


@pytest.mark.parametrize("codec_id", ["uniform", "binmean"])
def test_hostile_sections_are_refused(codec_id):
    values = np.random.default_rng(1).standard_normal(37).astype(np.float32)
    enc = create("value", {"id": codec_id, "bits": 3}).encode(values, CTX)
    codec = create("value", codec_id)
    nan_table = b"\x00\x00\xc0\x7f" + enc.payload[4:]
    padded = bytearray(enc.payload)
    padded[-1] |= 0x80                                    # 37 * 3 = 111 bits: the last bit is padding
    for params, payload, n in ((enc.params, enc.payload[:-1], 37), (enc.params, enc.payload + b"\0", 37),
                               (enc.params, enc.payload, 36), (b"", enc.payload, 37), (b"\x09", enc.payload, 37),
                               (b"\x03\x00", enc.payload, 37), (enc.params, enc.payload[:2], 37),
                               (enc.params, nan_table, 37), (enc.params, bytes(padded), 37)):
        with pytest.raises(ContainerError):
            codec.decode(params, payload, n)
            pytest.fail(f"{codec_id} accepted params {params!r}, {len(payload)} bytes for {n}")
    negative = b"\x00\x00\x80\xbf" + enc.payload[4:]
    if codec_id == "uniform":
        with pytest.raises(ContainerError, match="scale"):
            codec.decode(enc.params, negative, 37)


def test_config_errors():
    for bad in ({"id": "uniform", "bits": 0}, {"id": "uniform", "bits": 9}, {"id": "uniform", "kappa": 0.0},
                {"id": "binmean", "bits": 16}, {"id": "binmean", "iterations": -1}):
        with pytest.raises(ConfigError):
            create("value", bad)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), bits=st.integers(1, 8), seed=st.integers(0, 2**16),
       codec_id=st.sampled_from(["uniform", "binmean"]), scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e30]))
def test_decode_equals_reconstructed(n, bits, seed, codec_id, scale):
    values = (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)
    enc = create("value", {"id": codec_id, "bits": bits}).encode(values, CTX)
    out = create("value", codec_id).decode(enc.params, enc.payload, n)
    np.testing.assert_array_equal(out, enc.reconstructed)
    assert np.all(np.isfinite(out))


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 3000), cuts=st.integers(0, 20), seed=st.integers(0, 2**16), dups=st.booleans())
def test_binmean_bin_lookup_counts_as_searchsorted(n, cuts, seed, dups):
    """binmean's Lloyd step finds each value's bin by one comparison pass per cut (up to 15 cuts)
    instead of a binary search: the same counts, with repeated cuts and values equal to a cut."""
    from deepreduce.values.binmean import _bins_at
    rng = np.random.default_rng(seed)
    edges = np.sort(rng.standard_normal(cuts))
    if dups and cuts > 1:
        edges[1] = edges[0]
    wide = rng.standard_normal(n)
    if n and cuts:
        wide[: n // 3] = rng.choice(edges, n // 3)   # values on the cuts
    np.testing.assert_array_equal(_bins_at(edges, wide), np.searchsorted(edges, wide, side="right"))


@settings(max_examples=120, deadline=None)
@given(n=st.integers(0, 700), bits=st.integers(1, 8), seed=st.integers(0, 2**16),
       kind=st.sampled_from(["normal", "ties", "zeros", "nan"]))
def test_binmean_quantile_start_is_the_stable_sort_one(n, bits, seed, kind):
    """The equal-count start without a sort (up to 16 bins, finite values) gives the codes the
    stable sort gives: ties, -0.0 beside 0.0, more bins than values; NaN takes the sort."""
    from deepreduce.values.binmean import _quantile_start
    rng = np.random.default_rng(seed)
    v = {"normal": lambda: rng.standard_normal(n), "ties": lambda: rng.integers(-2, 3, n),
         "zeros": lambda: np.where(rng.random(n) < 0.5, -0.0, 0.0), "nan": lambda: rng.standard_normal(n)}[kind]()
    v = v.astype(np.float32)
    if kind == "nan" and n:
        v[rng.integers(0, n)] = np.nan
    bins = 1 << bits
    order = np.argsort(v, kind="stable")
    expected = np.empty(n, dtype=np.int64)
    expected[order] = (np.arange(n, dtype=np.int64) * bins) // max(n, 1)
    np.testing.assert_array_equal(_quantile_start(v, bins), expected)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 2000), bits=st.integers(1, 4), iterations=st.sampled_from([0, 1, 2, 8, 20]),
       seed=st.integers(0, 2**16), kind=st.sampled_from(["laplace", "ties", "zeros", "huge", "nan", "inf"]))
def test_binmean_kernel_fits_the_same_bins_as_the_numpy_code(n, bits, iterations, seed, kind):
    """The C++ bin fit (1-4 bits) gives fit_bins' means bit for bit and its codes, so the same
    containers: heavy tails, ties, -0.0 beside 0.0, magnitudes near float32's top, fewer values
    than bins; a NaN or Inf makes the kernel decline (None), and the codec then uses fit_bins."""
    from deepreduce.backend import kernels
    from deepreduce.values.binmean import fit_bins
    module = kernels.native()
    if module is None:
        pytest.skip("needs the C++ extensions (make setup)")
    rng = np.random.default_rng(seed)
    v = {"laplace": lambda: rng.laplace(size=n), "ties": lambda: rng.integers(-3, 4, n),
         "zeros": lambda: np.where(rng.random(n) < 0.5, -0.0, 0.0) + rng.integers(0, 2, n),
         "huge": lambda: rng.laplace(size=n) * 1e37, "nan": lambda: rng.standard_normal(n),
         "inf": lambda: rng.standard_normal(n)}[kind]().astype(np.float32)
    if kind in ("nan", "inf") and n:
        v[rng.integers(0, n)] = np.nan if kind == "nan" else -np.inf
        assert module.binmean_codes(v, bits, iterations) is None
        return
    means, codes = fit_bins(v, bits, iterations)
    got_means, got_codes = module.binmean_codes(v, bits, iterations)
    np.testing.assert_array_equal(got_means.view(np.uint32), means.view(np.uint32))
    np.testing.assert_array_equal(got_codes, codes)
    codec = create("value", {"id": "binmean", "bits": bits, "iterations": iterations})
    assert codec.encode(v, CTX).payload == means.astype("<f4").tobytes() + (
        bytes(bitpack.pack(codes.astype(np.uint64), bits)) if n else b"")


def test_binmean_kernel_refuses_bits_it_does_not_fit():
    from deepreduce.backend import kernels
    module = kernels.native()
    if module is None:
        pytest.skip("needs the C++ extensions (make setup)")
    with pytest.raises(ValueError, match="bits must be in"):
        module.binmean_codes(np.zeros(4, np.float32), 5, 8)
    with pytest.raises(ValueError, match="iterations must be"):
        module.binmean_codes(np.zeros(4, np.float32), 2, -1)
