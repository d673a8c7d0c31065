"""QSGD: unbiased stochastic rounding, the variance bound, seeding from (config, name, step)."""
from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

from deepreduce.backend import kernels
from deepreduce.errors import DeepReduceError
from deepreduce.values.qsgd import QSGD
from deepreduce.wire.seeding import EncodeContext

DIGEST = b"\x11" * 16


def draws(codec, u, count, name="w"):
    out = np.empty((count, u.size), dtype=np.float64)
    for step in range(count):
        enc = codec.encode(u, EncodeContext(DIGEST, name, step))
        out[step] = codec.decode(enc.params, enc.payload, u.size)
    return out


@pytest.mark.parametrize("levels,bucket", [(127, 512), (4, 64), (1, 1000)])
def test_mean_of_many_decodes_converges_to_the_input(levels, bucket):
    rng = np.random.default_rng(levels)
    u = rng.laplace(scale=1e-3, size=1000).astype(np.float32)
    k = 3000
    samples = draws(QSGD(levels=levels, bucket_size=bucket), u, k)
    mean = samples.mean(axis=0)
    # Per element, u_hat = nu/s * level with level in {l, l+1}: std <= nu / (2 s).
    nu = np.repeat([np.linalg.norm(u[i:i + bucket].astype(np.float64)) for i in range(0, u.size, bucket)],
                   bucket)[:u.size]
    tolerance = 5.0 * nu / (2 * levels) / np.sqrt(k) + 1e-9
    assert np.all(np.abs(mean - u) <= tolerance)
    # and the error of the mean shrinks like 1/sqrt(k)
    early = np.abs(samples[:k // 30].mean(axis=0) - u).mean()
    assert np.abs(mean - u).mean() < early / 3


@pytest.mark.parametrize("levels", [1, 2, 16, 127])
def test_variance_bound(levels):
    rng = np.random.default_rng(5)
    bucket = 256
    u = rng.normal(size=1024).astype(np.float32)
    samples = draws(QSGD(levels=levels, bucket_size=bucket), u, 300)
    for start in range(0, u.size, bucket):
        ub = u[start:start + bucket].astype(np.float64)
        err = ((samples[:, start:start + bucket] - ub) ** 2).sum(axis=1).mean()
        bound = min(bucket / levels ** 2, np.sqrt(bucket) / levels) * float(ub @ ub)
        assert err <= bound * 1.05


def test_rounding_is_seeded_by_config_name_and_step():
    u = np.random.default_rng(0).normal(size=600).astype(np.float32)
    c = QSGD(levels=3)
    a = c.encode(u, EncodeContext(DIGEST, "w", 1)).payload
    assert a == c.encode(u, EncodeContext(DIGEST, "w", 1)).payload
    assert a != c.encode(u, EncodeContext(DIGEST, "w", 2)).payload
    assert a != c.encode(u, EncodeContext(DIGEST, "v", 1)).payload
    assert a != c.encode(u, EncodeContext(b"\x12" * 16, "w", 1)).payload


def test_levels_never_exceed_s_and_zero_buckets_decode_to_zero():
    u = np.zeros(1030, dtype=np.float32)
    u[600] = 3.0                      # a bucket whose norm equals its only value
    u[1029] = -1e-30
    c = QSGD(levels=127)
    enc = c.encode(u, EncodeContext(DIGEST, "w", 0))
    q = np.frombuffer(enc.payload, dtype="i1", offset=4 * 3)
    assert q.max() == 127 and q.min() == -127
    out = c.decode(enc.params, enc.payload, u.size)
    assert out[600] == 3.0 and np.count_nonzero(out[:512]) == 0


native = pytest.importorskip("deepreduce._select", reason="needs the C++ extensions (make setup)")

from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _encode_both(u, levels, bucket, threads=1, name="w", step=3):
    """(C++ encoding, array-namespace encoding) of u."""
    codec = QSGD(levels=levels, bucket_size=bucket)
    codec.threads = threads
    ctx = EncodeContext(DIGEST, name, step)
    fast = codec.encode(u, ctx)
    with mock.patch("deepreduce.backend.kernels.native", return_value=None):
        slow = codec.encode(u, ctx)
    return fast, slow


@settings(max_examples=150, deadline=None)
@given(values=st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=0, max_size=700),
       levels=st.sampled_from([1, 3, 127, 128, 32767]), bucket=st.integers(1, 900),
       scale=st.sampled_from([1.0, 1e-30, 1e-3]))
@example(values=[0.0, -0.0, 1e-45, -1e-45], levels=127, bucket=3, scale=1.0)
def test_cxx_kernel_writes_the_array_namespace_bytes(values, levels, bucket, scale):
    u = (np.asarray(values, dtype=np.float32) * np.float32(scale)).astype(np.float32)
    codec = QSGD(levels=levels, bucket_size=bucket)
    overflow = np.isinf(np.float32(np.sqrt(np.sum(np.square(u, dtype=np.float64)))))
    if overflow:   # a bucket norm may exceed float32: both paths must agree on raising
        outcomes = []
        for native_module in (kernels.native(), None):
            with mock.patch("deepreduce.backend.kernels.native", return_value=native_module):
                try:
                    outcomes.append(bytes(codec.encode(u, EncodeContext(DIGEST, "w", 3)).payload))
                except DeepReduceError as exc:
                    outcomes.append(str(exc))
        assert outcomes[0] == outcomes[1]
        return
    fast, slow = _encode_both(u, levels, bucket)
    assert fast.params == slow.params
    assert bytes(fast.payload) == bytes(slow.payload)
    assert np.array_equal(np.asarray(fast.reconstructed), np.asarray(slow.reconstructed))


def test_cxx_kernel_threads_never_change_a_byte():
    u = np.random.default_rng(2).laplace(size=300_001).astype(np.float32)
    one, _ = _encode_both(u, 127, 512, threads=1)
    for threads in (2, 3, 8):
        many, slow = _encode_both(u, 127, 512, threads=threads)
        assert bytes(many.payload) == bytes(one.payload) == bytes(slow.payload)
        assert np.array_equal(many.reconstructed, one.reconstructed)


def test_cxx_kernel_reports_a_norm_that_overflows_float32():
    u = np.full(8, 3e38, dtype=np.float32)
    with pytest.raises(DeepReduceError, match="overflows float32"):
        QSGD(levels=127, bucket_size=8).encode(u, EncodeContext(DIGEST, "w", 0))
    assert native.qsgd_encode(u, 127, 8, 0, 1) is None


@pytest.mark.parametrize("args,message", [((0, 8, 0, 1), "levels"), ((32768, 8, 0, 1), "levels"),
                                          ((127, 0, 0, 1), "bucket_size"), ((127, 8, 0, 0), "threads")])
def test_cxx_kernel_checks_its_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        native.qsgd_encode(np.ones(4, np.float32), *args)
