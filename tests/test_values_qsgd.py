"""QSGD: unbiased stochastic rounding, the variance bound, seeding from (config, name, step)."""
from __future__ import annotations

import numpy as np
import pytest

from deepreduce.seeding import EncodeContext
from deepreduce.values.qsgd import QSGD

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
