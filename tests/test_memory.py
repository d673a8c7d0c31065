"""Error feedback loses nothing but float32 rounding: sum(sent) + final residual == sum(gradients).

The residual is float32 and updated in place; the bound (deepreduce/memory.py) is, per
element, ``|sum_t s_t + e_T - sum_t g_t| <= 2**-24 * sum_t (|c_t| + |e_t|)`` with ``c_t`` the
compensated gradient and ``e_t`` the residual after step ``t``.
"""
import numpy as np
import pytest

import deepreduce
from deepreduce import registry
from deepreduce.collective.routes.entries import decode_entries, encode_entries
from deepreduce.wire.seeding import EncodeContext

EPS32 = 2.0 ** -24

CASES = [
    ({"id": "topk", "ratio": 0.01}, "raw", "raw"),
    ({"id": "topk", "ratio": 0.05}, "raw", "fp16"),       # lossy values as well as dropped entries
    ({"id": "sidco", "ratio": 0.01}, "raw", "fp16"),
    ({"id": "dgc", "ratio": 0.001}, "raw", "raw"),
    ({"id": "randomk", "ratio": 0.02}, "raw", "qsgd"),
    ({"id": "threshold", "threshold": 2e-3}, "elias_fano", "raw"),
    ({"id": "topk", "ratio": 0.02}, "raw", "polyfit"),     # reordering values, order-keeping index
    ({"id": "topk", "ratio": 0.02}, {"id": "bloom", "policy": "p0"}, "polyfit"),  # permutation section
    ({"id": "topk", "ratio": 0.02}, {"id": "bloom", "policy": "naive", "fpr": 0.05}, "raw"),
    ({"id": "topk", "ratio": 0.02}, {"id": "bloom", "policy": "p2"}, "dexp"),
    ({"id": "topk", "ratio": 0.02}, "delta", "sketchml"),
    ({"id": "topk", "ratio": 0.02}, "raw", "sketchml_huffman"),
    ({"id": "topk", "ratio": 0.02}, "rle", "deflate"),
]


def _id(case):
    return "-".join(c if isinstance(c, str) else "_".join(str(v) for v in c.values()) for c in case)


@pytest.mark.parametrize("sparsifier,index,value", CASES, ids=[_id(c) for c in CASES])
def test_conservation_to_float32_rounding(sparsifier, index, value):
    pipe = deepreduce.build({"sparsifier": sparsifier, "index": index, "value": value,
                             "memory": {"id": "residual"}, "min_numel": 0})
    rng = np.random.default_rng(1)
    d, steps = 4000, 25
    for name, scale in (("a", 1e-3), ("b", 3.0)):
        sum_grad, sum_sent, bound = np.zeros(d), np.zeros(d), np.zeros(d)
        previous = np.zeros(d)
        for step in range(steps):
            g = (rng.laplace(scale=scale, size=d) + scale * 0.1).astype(np.float32)  # a drift grows residuals
            sum_grad += g
            sum_sent += pipe.decode(pipe.encode(g, name=name, step=step))
            residual = pipe.memory.residual(name)
            bound += EPS32 * (np.abs(previous + g) * (1 + 2 * EPS32) + np.abs(residual))
            previous = residual.astype(np.float64)
        assert residual.dtype == np.float32
        err = np.abs(sum_sent + previous - sum_grad)
        assert np.all(err <= bound * (1 + 1e-9) + 1e-300), (name, float(err.max()), float(bound.max()))
        assert np.abs(previous).max() > 0  # something really was held back


def test_residual_is_float32_state_updated_in_place():
    pipe = deepreduce.build({"sparsifier": {"id": "topk", "ratio": 0.1}, "index": "raw", "value": "raw",
                             "memory": "residual", "min_numel": 0})
    g = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    pipe.encode(g, name="w", step=0)
    buffer = pipe.memory._residuals["w"]
    assert buffer.dtype == np.float32 and buffer.shape == (1000,)
    payload = pipe.encode(g, name="w", step=1)
    assert pipe.memory._residuals["w"] is buffer  # the same buffer, updated in place
    sent = pipe.decode(payload).ravel()
    assert np.count_nonzero(sent) == 100
    # the sent entries were carried exactly (raw values), so their residual is exactly zero
    assert np.all(buffer[sent != 0] == 0)


def test_dense_small_tensors_and_reset():
    pipe = deepreduce.build({"sparsifier": {"id": "topk", "ratio": 0.1}, "index": {"id": "raw"},
                             "value": {"id": "fp16"}, "memory": {"id": "residual"}, "min_numel": 100})
    g = np.linspace(-1, 1, 50, dtype=np.float32) / 3
    total = np.zeros(50)
    for step in range(5):
        total += pipe.decode(pipe.encode(g, name="small", step=step))
    # a dense container carries the compensated gradient exactly: nothing is left behind
    np.testing.assert_array_equal(pipe.memory.residual("small"), np.zeros(50, np.float32))
    np.testing.assert_array_equal(total, 5 * g.astype(np.float64))
    pipe.memory.reset()
    assert pipe.memory.residual("small") is None


def test_warmup_steps_travel_dense_then_error_feedback_starts_from_zero():
    pipe = deepreduce.build({"sparsifier": {"id": "topk", "ratio": 0.01}, "index": "raw", "value": "fp16",
                             "memory": "residual", "warmup": 2})
    rng = np.random.default_rng(3)
    for step in range(2):   # lossless: the whole compensated gradient, nothing left behind
        g = rng.standard_normal(5000).astype(np.float32)
        np.testing.assert_array_equal(pipe.decode(pipe.encode(g, name="w", step=step)), g)
        np.testing.assert_array_equal(pipe.memory.residual("w"), np.zeros(5000, np.float32))
    g = rng.standard_normal(5000).astype(np.float32)
    sent = pipe.decode(pipe.encode(g, name="w", step=2))
    assert np.count_nonzero(sent) == 50
    np.testing.assert_allclose(sent + pipe.memory.residual("w"), g, rtol=0, atol=1e-3)   # fp16 values


@pytest.mark.parametrize("memory", ["none", "residual"])
def test_warmup_sends_a_sparse_gradient_whole(memory):
    pipe = deepreduce.build({"sparsifier": {"id": "topk", "ratio": 0.1}, "index": "raw", "value": "raw",
                             "memory": memory, "warmup": 1})
    positions = np.arange(0, 10_000, 10, dtype=np.int64)
    values = np.random.default_rng(4).standard_normal(positions.shape[0]).astype(np.float32)
    counts = [np.count_nonzero(pipe.decode(encode_entries(pipe, positions, values, (10_000,), name="e", step=step)))
              for step in (0, 1)]
    assert counts == [1000, 100]


def test_nonfinite_step_leaves_the_residual_alone():
    pipe = deepreduce.build({"sparsifier": {"id": "topk", "ratio": 0.05}, "index": "raw", "value": "fp16",
                             "memory": "residual", "min_numel": 0})
    rng = np.random.default_rng(3)
    d = 3 * 4096 + 17
    pipe.encode(rng.standard_normal(d).astype(np.float32), name="w", step=0)
    before = pipe.memory.residual("w").copy()
    bad = rng.standard_normal(d).astype(np.float32)
    bad[5000] = np.nan
    payload = pipe.encode(bad, name="w", step=1)
    assert deepreduce.inspect(payload)["nonfinite"]
    after = pipe.memory.residual("w")
    # restored to within two float32 roundings of (residual + g) per entry; the block holding
    # the NaN was never touched
    np.testing.assert_allclose(after, before, rtol=0, atol=float(np.abs(before + bad)[np.isfinite(bad)].max()) * 2 * EPS32)
    np.testing.assert_array_equal(after[4096:8192], before[4096:8192])


def test_compensate_leaves_state_alone():
    mem = registry.create("memory", {"id": "residual"})
    x = np.ones(4, np.float32)
    mem.accumulate("t", x)
    mem.settle("t", np.array([1]), np.array([0.25], np.float32))
    np.testing.assert_array_equal(mem.compensate("t", x), [2, 1.75, 2, 2])
    np.testing.assert_array_equal(mem.residual("t"), [1, 0.75, 1, 1])


def test_memory_reports_size_change():
    mem = registry.create("memory", {"id": "residual"})
    x = np.ones(4, np.float32)
    mem.accumulate("t", x)
    with pytest.raises(deepreduce.CommunicationError, match="keep its size"):
        mem.accumulate("t", np.ones(5, np.float32))


@pytest.mark.parametrize("value", registry.ids("value"))
def test_value_codecs_hand_back_what_the_receiver_decodes(value):
    codec = registry.create("value", {"id": value})
    ctx = EncodeContext(b"\0" * 16, "t", 3)
    rng = np.random.default_rng(7)
    for n in (0, 1, 3, 700):
        values = rng.laplace(scale=1e-2, size=n).astype(np.float32)
        enc = codec.encode(values, ctx)
        assert enc.reconstructed is not None and enc.reconstructed.dtype == np.float32
        decoded = codec.decode(enc.params, enc.payload, n)
        expected = np.empty(n, np.float32)
        expected[enc.order if enc.order is not None else np.arange(n)] = decoded
        np.testing.assert_array_equal(enc.reconstructed, expected)


SPARSE_CASES = [
    ({"id": "topk", "ratio": 0.3}, "raw", "raw"),
    ({"id": "topk", "ratio": 0.3}, "elias_fano", "fp16"),                  # lossy values
    ({"id": "none"}, {"id": "bloom", "policy": "p0", "fpr": 0.05}, "raw"),   # false positives are sent too
]


def _touched_rows(rng, rows, width, touched):
    """A sparse embedding gradient as entries: ``touched`` distinct rows of a rows x width table."""
    chosen = np.sort(rng.choice(rows, touched, replace=False))
    positions = (chosen[:, None] * width + np.arange(width)).reshape(-1)
    return positions, rng.standard_normal(positions.shape[0]).astype(np.float32)


@pytest.mark.parametrize("sparsifier,index,value", SPARSE_CASES, ids=[_id(c) for c in SPARSE_CASES])
def test_sparse_gradients_keep_a_sparse_residual_that_conserves_mass(sparsifier, index, value):
    """Entries (routes.entries.encode_entries) with error feedback: what the receivers decode plus the
    residual equals the sum of the gradients, and the residual never holds more entries than the
    rows ever touched (it is a SparseResidual, not a dense table)."""
    from deepreduce.memory import SparseResidual

    rows, width = 5_000, 8
    pipe = deepreduce.build({"sparsifier": sparsifier, "index": index, "value": value,
                             "memory": {"id": "residual"}, "min_numel": 0})
    rng = np.random.default_rng(3)
    total, sent = np.zeros(rows * width, np.float64), np.zeros(rows * width, np.float64)
    ever = set()
    for step in range(8):
        positions, values = _touched_rows(rng, rows, width, 40)
        ever.update(positions.tolist())
        np.add.at(total, positions, values)
        payload = encode_entries(pipe, positions, values, (rows, width), name="emb", step=step)
        got_positions, got_values = decode_entries(pipe, [payload], (rows, width))
        np.add.at(sent, got_positions, got_values)
        held = pipe.memory._residuals["emb"]
        assert isinstance(held, SparseResidual) and held.positions.shape[0] <= len(ever | set(got_positions.tolist()))
    residual = pipe.memory._residuals["emb"].dense()
    np.testing.assert_allclose(sent + residual, total, rtol=0, atol=1e-4)
    assert np.abs(residual).sum() > 0 or sparsifier["id"] == "none"


def test_sparse_residual_checkpoints_densifies_and_overflows_cleanly():
    """A sparse residual round-trips through state_dict (bad entries refused), becomes dense when
    the tensor later travels dense, and a compensation beyond float32 travels flagged."""
    from deepreduce.errors import ConfigError
    from deepreduce.memory import SparseResidual
    from deepreduce.wire import container

    config = {"sparsifier": {"id": "topk", "ratio": 0.25}, "index": "raw", "value": "raw",
              "memory": {"id": "residual"}, "min_numel": 0, "nonfinite": "propagate"}
    pipe = deepreduce.build(config)
    positions = np.array([3, 10, 11, 40], np.int64)
    encode_entries(pipe, positions, np.array([1.0, -4.0, 2.0, 0.5], np.float32), (64,), name="e", step=0)
    state = pipe.state_dict()
    again = deepreduce.build(config)
    again.load_state_dict(state)
    held = again.memory._residuals["e"]
    assert isinstance(held, SparseResidual) and held.positions.tolist() == [3, 11, 40]
    for bad in ({"positions": np.array([5, 2]), "values": np.ones(2, np.float32), "numel": 64},
                {"positions": np.array([70]), "values": np.ones(1, np.float32), "numel": 64},
                {"positions": np.array([1]), "values": np.array([np.nan], np.float32), "numel": 64}):
        broken = pipe.state_dict()
        broken["memory"]["residuals"]["e"] = bad
        with pytest.raises(ConfigError, match="residual 'e'"):
            deepreduce.build(config).load_state_dict(broken)
    assert again.memory.residual("e")[[3, 11, 40]].tolist() == [1.0, 2.0, 0.5]   # densified for good
    again.encode(np.zeros(64, np.float32), name="e", step=1)
    assert isinstance(again.memory._residuals["e"], np.ndarray)

    big = np.float32(3e38)
    encode_entries(pipe, np.array([7, 8], np.int64), np.array([big, 1.1 * big], np.float32), (64,), name="o", step=0)
    assert pipe.memory._residuals["o"].positions.tolist() == [7]   # the larger one was sent
    payload = encode_entries(pipe, np.array([7], np.int64), np.array([big], np.float32), (64,), name="o", step=1)
    assert container.unpack(payload).flags & container.FLAG_NONFINITE
    assert pipe.memory._residuals["o"].positions.shape[0] == 0
