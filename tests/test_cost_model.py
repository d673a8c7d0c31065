"""The cost model's formulas on hand-computed numbers, its fits, and the probe on the real pipeline."""
from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepreduce.collective.cost_model import (
    CodecCosts,
    Link,
    PowerSGDCosts,
    allgather_cost,
    allgather_s,
    alltoall_s,
    dense_cost,
    fit_link,
    powersgd_cost,
    ring_allreduce_s,
    sparse_allreduce_cost,
)
from deepreduce.collective.cost_probe import measure_codec_costs, measure_powersgd_costs
from deepreduce.collective.linear_fit import fit_nonnegative
from deepreduce.errors import ConfigError

LINK = Link(alpha_s=1e-5, bandwidth=1e9)


def codec(**changes) -> CodecCosts:
    """Synthetic costs with round numbers: 1 us + 1 ns/elem encode, 2 us + 10 ns/entry decode."""
    fields = dict(name="raw", ratio=0.01, encode_call_s=1e-6, encode_element_s=1e-9, decode_call_s=2e-6,
                  decode_element_s=0.0, decode_entry_s=1e-8, header_bytes=40.0, entry_bytes=8.0)
    return CodecCosts(**{**fields, **changes})


def test_link_from_gbit_and_seconds():
    link = Link.from_gbit(10, alpha_s=2e-5)
    assert link.bandwidth == 1.25e9
    assert link.seconds(3, 2.5e9) == pytest.approx(3 * 2e-5 + 2.0)


def test_ring_allreduce_hand_computed():
    # N = 4, 1 MB: 2 * 3 latencies + 2 * 3/4 * 1e6 bytes at 1 GB/s
    assert ring_allreduce_s(LINK, 4, 1e6) == pytest.approx(6e-5 + 1.5e-3)
    assert ring_allreduce_s(LINK, 1, 1e6) == 0.0


def test_allgather_and_alltoall_hand_computed():
    assert allgather_s(LINK, 4, 1000) == pytest.approx(3 * (1e-5 + 1e-6))
    # uneven splits: each round moves the larger of what it sends and receives
    assert alltoall_s(LINK, [100, 0, 300], [200, 50, 0]) == pytest.approx(3e-5 + (200 + 50 + 300) / 1e9)
    with pytest.raises(ConfigError, match="sent has 2 peers, received 1"):
        alltoall_s(LINK, [1, 2], [3])


def test_dense_and_fp16_costs():
    fp32, fp16 = dense_cost(LINK, 8, 1e6), dense_cost(LINK, 8, 1e6, itemsize=2)
    assert fp32.received_bytes == pytest.approx(2 * 7 / 8 * 4e6)
    assert fp32.total_s == pytest.approx(14e-5 + 2 * 7 / 8 * 4e6 / 1e9)
    assert fp16.received_bytes == pytest.approx(fp32.received_bytes / 2)


def test_allgather_cost_hand_computed():
    c = codec()
    cost = allgather_cost(LINK, 4, 1e6, c)       # k = 10,000 entries, 80,040-byte containers
    assert cost.encode_s == pytest.approx(1e-6 + 1e-3)
    assert cost.comm_s == pytest.approx(3 * (1e-5 + 80040 / 1e9))
    assert cost.decode_s == pytest.approx(3 * (2e-6 + 1e4 * 1e-8))
    assert cost.received_bytes == pytest.approx(3 * 80040)


def test_sparse_allreduce_cost_hand_computed():
    c = codec()
    cost = sparse_allreduce_cost(LINK, 4, 1e6, c)   # shards of 250,000 elements, 2,500 entries
    shard_bytes = 40 + 8 * 2500
    assert cost.encode_s == pytest.approx(1e-9 * 1e6 + 4 * 1e-6 + (1e-6 + 1e-9 * 250000))
    assert cost.comm_s == pytest.approx(3 * (1e-5 + shard_bytes / 1e9) * 2)
    assert cost.decode_s == pytest.approx(3 * 2 * (2e-6 + 2500 * 1e-8))
    assert cost.received_bytes == pytest.approx(3 * 2 * shard_bytes)
    exact = sparse_allreduce_cost(LINK, 4, 1e6, c, reselect=False)   # the union: up to k per shard
    assert exact.received_bytes == pytest.approx(3 * (shard_bytes + 40 + 8 * 1e4))


@given(ranks=st.integers(2, 4096), numel=st.integers(10_000, 10 ** 9))
def test_sparse_allreduce_receives_ok_topk_bound(ranks, numel):
    """Entries received from other ranks: 2k(N-1)/N (Ok-Topk's lower bound), whatever N."""
    c = codec(header_bytes=0.0, entry_bytes=1.0)
    k = c.entries(numel)
    received = sparse_allreduce_cost(LINK, ranks, numel, c).received_bytes
    assert received == pytest.approx(2 * k * (ranks - 1) / ranks)
    assert received <= 3 * k


def test_bloom_decode_is_per_element_per_container():
    """A per-element decoder costs (N-1) d with allgather, about 2d with the sparse all-reduce."""
    bloom = codec(decode_call_s=0.0, decode_entry_s=0.0, decode_element_s=1e-9)
    d, n = 1e7, 64
    assert allgather_cost(LINK, n, d, bloom).decode_s == pytest.approx((n - 1) * d * 1e-9)
    assert sparse_allreduce_cost(LINK, n, d, bloom).decode_s == pytest.approx(2 * (n - 1) / n * d * 1e-9)


def test_powersgd_cost_hand_computed():
    costs = PowerSGDCosts(mac_s=1e-12, orth_s=1e-10, element_s=1e-11)
    shapes = [(16, 16, 3, 3), (64, 32), (10,), (4, 4)]   # two compressed, a bias and a too-small matrix dense
    cost = powersgd_cost(LINK, 2, shapes, 4, costs)
    p, q, dense = 16 * 4 + 64 * 4, 144 * 4 + 32 * 4, 10 + 16
    assert cost.comm_s == pytest.approx(sum(ring_allreduce_s(LINK, 2, 4 * f) for f in (p, q, dense)))
    compute = sum(1e-12 * 3 * n * m * 4 + 1e-10 * n * 16 + 1e-11 * 2 * n * m for n, m in ((16, 144), (64, 32)))
    assert cost.encode_s == pytest.approx(compute)
    assert cost.received_bytes == pytest.approx(4 * (p + q + dense))
    with pytest.raises(ConfigError, match="powersgd rank"):
        powersgd_cost(LINK, 2, shapes, 0, costs)


def test_fit_link_recovers_alpha_and_bandwidth():
    sizes = [1e3, 1e5, 1e7]
    link = fit_link(sizes, [ring_allreduce_s(LINK, 8, b) for b in sizes], 8)
    assert link.alpha_s == pytest.approx(1e-5) and link.bandwidth == pytest.approx(1e9)
    with pytest.raises(ConfigError, match="ranks >= 2"):
        fit_link(sizes, [1.0, 1.0, 1.0], 1)


def test_fit_nonnegative():
    xs = [1.0, 2.0, 4.0, 8.0]
    assert fit_nonnegative([[1.0] * 4, xs], [3 + 2 * x for x in xs], "y") == pytest.approx([3.0, 2.0])
    # a decreasing series would need a negative slope: that column is left out
    assert fit_nonnegative([[1.0] * 4, xs], [5.0, 4.0, 3.0, 2.0], "y")[1] == 0.0
    with pytest.raises(ConfigError, match="y: need one or more positive"):
        fit_nonnegative([xs], [1.0, 0.0, 1.0, 1.0], "y")


@pytest.mark.parametrize("changes, message", [
    (dict(ratio=0.0), "ratio must be in"),
    (dict(encode_element_s=-1e-9), "encode_element_s must be a finite number"),
    (dict(entry_bytes=math.inf), "entry_bytes must be a finite number"),
    (dict(name=""), "name must be a non-empty string"),
])
def test_codec_costs_refuse_bad_values(changes, message):
    with pytest.raises(ConfigError, match=message):
        codec(**changes)


def test_link_refuses_bad_values_and_dicts_round_trip():
    with pytest.raises(ConfigError, match="link bandwidth must be > 0"):
        Link(1e-5, 0.0)
    with pytest.raises(ConfigError, match="link alpha_s"):
        Link(-1.0, 1e9)
    assert Link.from_dict(LINK.to_dict()) == LINK
    assert CodecCosts.from_dict(codec().to_dict()) == codec()
    with pytest.raises(ConfigError, match="unknown keys \\['extra'\\]"):
        CodecCosts.from_dict({**codec().to_dict(), "extra": 1})


def test_measure_codec_costs_on_the_real_pipeline():
    costs = measure_codec_costs("topk_raw", sizes=(4096, 8192, 16384), repeat=1, note="test")
    assert costs.name == "topk_raw" and costs.ratio == 0.01 and costs.note == "test"
    assert costs.entry_bytes == pytest.approx(8.0, abs=0.1)        # a 4-byte index and a 4-byte value
    assert costs.encode_s(16384) > 0 and costs.decode_s(16384, 163) > 0
    with pytest.raises(ConfigError, match="sizes must be integers >= 1000"):
        measure_codec_costs("topk_raw", sizes=(10,))
    with pytest.raises(ConfigError, match="clock must be one of"):
        measure_codec_costs("topk_raw", sizes=(4096,), clock="sundial")


def test_every_timed_encode_of_the_codec_probe_gets_a_gradient_it_has_not_encoded(monkeypatch):
    """Re-encoding one array times it from the cache (1.7x faster at a few million elements), so
    the probe draws a new gradient for every encode it times."""
    from deepreduce.collective import cost_probe

    seen, alive = {}, []   # alive: no pipeline's id is reused while the probe runs
    real = cost_probe.encode_shards

    def recording(pipeline, grad, name, step, bounds):
        alive.append(pipeline)
        seen.setdefault((id(pipeline), len(bounds)), []).append(grad.tobytes())
        return real(pipeline, grad, name, step, bounds)

    monkeypatch.setattr(cost_probe, "encode_shards", recording)
    measure_codec_costs("topk_raw", sizes=(4096,), repeat=3)
    timed = [calls for calls in seen.values() if len(calls) > 1]   # the peer encodes once per size, untimed
    assert len(timed) == 4   # 2 ratios x (1 and SHARDS containers)
    assert all(len(calls) == 4 and len(set(calls)) == 4 for calls in timed)   # warm-up + 3, all different


def test_measure_powersgd_costs():
    costs = measure_powersgd_costs(rank=4, shape=(64, 256), repeat=1, clock="wall")
    assert min(costs.mac_s, costs.orth_s, costs.element_s) > 0
