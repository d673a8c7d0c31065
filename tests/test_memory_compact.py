"""Compact error feedback (``compact_residual``): the residual as int8 codes with one float32 scale
per block, re-quantised after every step (LoCo's compact error)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import deepreduce
from deepreduce import registry
from deepreduce.collective.routes.entries import decode_entries, encode_entries
from deepreduce.errors import CommunicationError, ConfigError
from deepreduce.memory_compact import LEVELS, blocks, dequantise, quantise
from deepreduce.torch.fsdp_checkpoint import nbytes

EPS32 = 2.0 ** -24


def _config(memory=None, ratio=1.0, index="rle", value=None):
    return {"sparsifier": {"id": "topk", "ratio": ratio}, "index": index,
            "value": value or {"id": "binmean", "bits": 1},
            "memory": memory or {"id": "compact_residual"}, "min_numel": 0}


def _half_step(x: np.ndarray, block: int) -> np.ndarray:
    """Per element, half the quantisation step of its block: max|x| / 254, with float32 slack."""
    count = blocks(x.shape[0], block)
    padded = np.zeros(count * block)
    padded[:x.shape[0]] = np.abs(x)
    peak = padded.reshape(count, block).max(axis=1) / (2 * LEVELS)
    return np.repeat(peak, block)[:x.shape[0]] * (1 + 1e-5) + 1e-30


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 700), st.sampled_from([1, 7, 64, 256]), st.integers(0, 2 ** 32 - 1),
       st.floats(1e-30, 1e30))
def test_round_trip_is_within_half_a_step_of_each_block(numel, block, seed, scale):
    x = (np.random.default_rng(seed).standard_normal(numel) * scale).astype(np.float32)
    held = quantise(x, block)
    assert held.codes.dtype == np.int8 and held.codes.shape == (numel,)
    assert held.scales.dtype == np.float32 and held.scales.shape == (blocks(numel, block),)
    assert np.abs(held.codes.astype(int)).max(initial=0) <= LEVELS
    back = dequantise(held, block)
    assert back.dtype == np.float32
    assert np.all(np.abs(back.astype(np.float64) - x) <= _half_step(x.astype(np.float64), block))


def test_zero_and_nonfinite_blocks_are_stored_as_zeros():
    x = np.ones(12, np.float32)
    x[:4] = 0.0
    x[9] = np.inf
    held = quantise(x, 4)
    np.testing.assert_array_equal(held.scales, [0.0, np.float32(1 / 127), 0.0])
    np.testing.assert_array_equal(dequantise(held, 4), [0] * 4 + [1] * 4 + [0] * 4)


@pytest.mark.parametrize("block", [64, 5])
def test_conservation_up_to_the_quantisation_bound(block):
    """sum_t s_t + e_T - sum_t g_t is the sum of each step's re-quantisation error."""
    pipe = deepreduce.build(_config({"id": "compact_residual", "block": block}))
    rng = np.random.default_rng(3)
    d = 3001
    total, sent, bound = np.zeros(d), np.zeros(d), np.zeros(d)
    held = np.zeros(d)
    for step in range(25):
        g = (rng.laplace(scale=1e-2, size=d) + 1e-3).astype(np.float32)
        s = pipe.decode(pipe.encode(g, "w", step)).astype(np.float64)
        error = held + g - s                       # what is quantised this step
        bound += _half_step(error, block) + 4 * EPS32 * (np.abs(held) + np.abs(g) + np.abs(s))
        held = pipe.memory.residual("w").astype(np.float64)
        total += g
        sent += s
    assert np.abs(held).max() > 0
    assert np.all(np.abs(sent + held - total) <= bound)


def test_decayed_conservation_up_to_the_quantisation_bound():
    """sum_t decay**(T-t) (g_t - s_t) = e_T, up to each step's re-quantisation error (decayed too)."""
    decay = float(np.float32(0.5))
    pipe = deepreduce.build(_config({"id": "compact_residual", "decay": 0.5}, ratio=0.2, index="elias_fano",
                                    value="raw"))
    rng = np.random.default_rng(4)
    d = 2000
    held, bound, expected = np.zeros(d), np.zeros(d), np.zeros(d)
    for step in range(20):
        g = rng.laplace(scale=1e-2, size=d).astype(np.float32)
        s = pipe.decode(pipe.encode(g, "w", step)).astype(np.float64)
        error = decay * held + g - s
        bound = decay * bound + _half_step(error, 64) + 4 * EPS32 * (np.abs(held) + np.abs(g) + np.abs(s))
        expected = decay * expected + g - s
        held = pipe.memory.residual("w").astype(np.float64)
    assert np.abs(held).max() > 0
    assert np.all(np.abs(held - expected) <= bound)


def test_every_block_scale_is_one_float_and_state_bytes_count_the_codes():
    pipe = deepreduce.build(_config({"id": "compact_residual", "block": 64}))
    pipe.encode(np.random.default_rng(0).standard_normal(1000).astype(np.float32), "w", 0)
    state = pipe.state_dict()["memory"]
    assert state["residuals"]["w"]["codes"].dtype == np.int8
    assert nbytes(state) == 1000 + 4 * 16 == pipe.memory.nbytes()


def test_state_dict_round_trip_sends_the_same_bytes():
    a, b = deepreduce.build(_config()), deepreduce.build(_config())
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(777).astype(np.float32) for _ in range(4)]
    for step in range(2):
        a.encode(grads[step], "w", step)
    b.load_state_dict(a.state_dict())
    for step in range(2, 4):
        assert a.encode(grads[step], "w", step).tobytes() == b.encode(grads[step], "w", step).tobytes()
    np.testing.assert_array_equal(a.memory.residual("w"), b.memory.residual("w"))


@pytest.mark.parametrize("state,match", [
    ({}, "keys"),
    ({"residuals": []}, "dict of name"),
    ({"residuals": {1: {"codes": np.zeros(4, np.int8), "scales": np.zeros(1, np.float32)}}}, "strings"),
    ({"residuals": {"w": {"codes": np.zeros(4, np.int8)}}}, "keys"),
    ({"residuals": {"w": {"codes": np.full(4, 128, np.int16), "scales": np.zeros(1, np.float32)}}}, "-127, 127"),
    ({"residuals": {"w": {"codes": np.zeros(4, np.float32), "scales": np.zeros(1, np.float32)}}}, "int"),
    ({"residuals": {"w": {"codes": np.zeros(65, np.int8), "scales": np.zeros(1, np.float32)}}}, "2 entries"),
    ({"residuals": {"w": {"codes": np.zeros(4, np.int8), "scales": np.full(1, -1.0, np.float32)}}}, "negative"),
    ({"residuals": {"w": {"codes": np.zeros(4, np.int8), "scales": np.full(1, np.nan, np.float32)}}}, "NaN"),
])
def test_bad_checkpoints_are_config_errors_and_change_nothing(state, match):
    mem = registry.create("memory", {"id": "compact_residual"})
    mem.accumulate("t", np.ones(4, np.float32))
    mem.settle("t", None, None)
    before = mem.state_dict()
    with pytest.raises(ConfigError, match=match):
        mem.load_state_dict(state)
    assert set(mem.state_dict()["residuals"]) == set(before["residuals"])


@pytest.mark.parametrize("memory,match", [
    ({"id": "compact_residual", "bits": 4}, "bits"),
    ({"id": "compact_residual", "block": 0}, "block"),
    ({"id": "compact_residual", "block": 1.5}, "block"),
    ({"id": "compact_residual", "average": 0.0}, "average"),
    ({"id": "compact_residual", "average": 1.5}, "average"),
    ({"id": "compact_residual", "decay": 0.0}, "decay"),
])
def test_wrong_config_keys_and_values_are_config_errors(memory, match):
    with pytest.raises(ConfigError, match=match):
        deepreduce.build(_config(memory))


def test_config_round_trip():
    pipe = deepreduce.build(_config({"id": "compact_residual", "block": 32, "average": 0.5}))
    assert pipe.get_config()["memory"] == {"id": "compact_residual", "block": 32, "average": 0.5, "decay": 1.0}


def test_nonfinite_gradient_and_undo_leave_the_stored_residual_alone():
    pipe = deepreduce.build(dict(_config(), nonfinite="propagate"))
    rng = np.random.default_rng(2)
    pipe.encode(rng.standard_normal(300).astype(np.float32), "w", 0)
    before = pipe.memory.state_dict()["residuals"]["w"]
    bad = rng.standard_normal(300).astype(np.float32)
    bad[7] = np.nan
    assert not pipe.memory.accumulate("w", bad).finite
    after = pipe.memory.state_dict()["residuals"]["w"]
    np.testing.assert_array_equal(after["codes"], before["codes"])
    np.testing.assert_array_equal(after["scales"], before["scales"])



def test_an_undone_step_restores_the_codes_and_resends_the_same_bytes():
    pipe = deepreduce.build(dict(_config(), nonfinite="raise"))   # a collective step keeps a journal
    rng = np.random.default_rng(2)
    pipe.encode(rng.standard_normal(300).astype(np.float32), "w", 0)
    before = pipe.memory.state_dict()["residuals"]["w"]
    pipe.collective_steps()
    g = rng.standard_normal(300).astype(np.float32)
    first = pipe.encode(g, "w", 1)
    assert not np.array_equal(pipe.memory.state_dict()["residuals"]["w"]["codes"], before["codes"])
    pipe.undo_step()
    np.testing.assert_array_equal(pipe.memory.state_dict()["residuals"]["w"]["codes"], before["codes"])
    np.testing.assert_array_equal(pipe.memory.state_dict()["residuals"]["w"]["scales"], before["scales"])
    assert pipe.encode(g, "w", 1).tobytes() == first.tobytes()
    pipe.commit_step()


def test_a_size_change_is_refused():
    mem = registry.create("memory", {"id": "compact_residual"})
    mem.accumulate("t", np.ones(8, np.float32))
    mem.settle("t", np.array([0]), np.array([0.5], np.float32))
    with pytest.raises(CommunicationError, match="keep its size"):
        mem.accumulate("t", np.ones(9, np.float32))


def test_settle_without_accumulate_is_refused():
    from deepreduce.errors import DeepReduceError
    mem = registry.create("memory", {"id": "compact_residual"})
    with pytest.raises(DeepReduceError, match="without being accumulated"):
        mem.settle("t", None, None)


def test_moving_average_and_take():
    mem = registry.create("memory", {"id": "compact_residual", "block": 4, "average": 0.5})
    x = np.array([1.0, 2.0, 4.0, -4.0], np.float32)
    np.testing.assert_array_equal(mem.accumulate("t", x).flat, x)
    mem.settle("t", np.array([2, 3]), np.array([4.0, -4.0], np.float32))
    first = mem.residual("t")                      # nothing held before: the error as it is
    np.testing.assert_allclose(first, [1, 2, 0, 0], atol=2 / 254)
    comp = mem.accumulate("t", x)
    np.testing.assert_allclose(comp.flat, first + x)
    mem.settle("t", None, None)                    # all sent: error 0, averaged with what was held
    np.testing.assert_allclose(mem.residual("t"), 0.5 * first, atol=1 / 254)
    taken = mem.take("t")
    np.testing.assert_allclose(taken, 0.5 * first, atol=1 / 254)
    assert mem.take("t") is None and not mem.residual("t").any()


def test_entries_conserve_up_to_the_quantisation_bound():
    pipe = deepreduce.build({"sparsifier": {"id": "topk", "ratio": 0.25}, "index": "raw", "value": "raw",
                             "memory": {"id": "compact_residual", "block": 8}, "min_numel": 0})
    positions = np.array([1, 5, 9, 20], np.int64)
    values = np.array([1.0, 8.0, 2.0, 4.0], np.float32)
    payload = encode_entries(pipe, positions, values, (32,), name="e", step=0)
    got_positions, got_values = decode_entries(pipe, [payload], (32,))
    np.testing.assert_array_equal(got_positions, [5])
    held = pipe.memory.residual("e")
    expected = np.zeros(32, np.float32)
    expected[[1, 9, 20]] = [1.0, 2.0, 4.0]
    np.testing.assert_allclose(held, expected, atol=4 / 254 * 1.0001)
    payload = encode_entries(pipe, np.array([3], np.int64), np.array([0.5], np.float32), (32,), name="e", step=1)
    got_positions, _ = decode_entries(pipe, [payload], (32,))
    np.testing.assert_array_equal(got_positions, [20])   # the held 4 beats the new 0.5


def test_torch_tensors_give_the_numpy_containers():
    import warnings

    import torch
    host, device = deepreduce.build(_config()), deepreduce.build(_config())
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # codecs without a device path run on the host
        for step in range(3):
            g = rng.standard_normal(1000).astype(np.float32)
            expected = host.encode(g, "w", step)
            got = device.encode(torch.from_numpy(g.copy()), "w", step)
            assert bytes(got.numpy() if isinstance(got, torch.Tensor) else got) == expected.tobytes()
    np.testing.assert_array_equal(device.memory.residual("w"), host.memory.residual("w"))
