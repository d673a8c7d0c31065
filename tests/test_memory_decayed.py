"""Decayed error feedback (``decayed_residual``, SparseLoCo's accumulator): e <- beta e + g, send
from e, e <- e - what the receiver reconstructs."""
import numpy as np
import pytest

import deepreduce
from deepreduce import registry
from deepreduce.collective.routes.entries import decode_entries, encode_entries
from deepreduce.errors import ConfigError
from deepreduce.wire import container

EPS32 = 2.0 ** -24


def _config(memory, sparsifier=None, index="chunk_fixed", value="uniform"):
    sparsifier = sparsifier or {"id": "chunk_topk", "chunk": 512, "k": 8}
    if index.startswith("chunk_"):
        index = {"id": index, "chunk": sparsifier["chunk"]}
    return {"sparsifier": sparsifier, "index": index, "value": value, "memory": memory, "min_numel": 0}


@pytest.mark.parametrize("sparsifier,index,value", [
    ({"id": "chunk_topk", "chunk": 512, "k": 8}, "chunk_enum", "binmean"),
    ({"id": "topk", "ratio": 0.02}, "elias_fano", "fp16"),   # the fused Top-r selection (deterministic codecs:
    # a seeded one such as qsgd draws from the config digest, which names the memory)
])
def test_decay_one_is_the_residual_memory_byte_for_byte(sparsifier, index, value):
    plain = deepreduce.build(_config({"id": "residual"}, sparsifier, index, value))
    decayed = deepreduce.build(_config({"id": "decayed_residual", "decay": 1.0}, sparsifier, index, value))
    rng = np.random.default_rng(0)
    for step in range(6):
        g = (rng.laplace(size=5000) + 0.1).astype(np.float32)
        a, b = container.unpack(plain.encode(g, "w", step)), container.unpack(decayed.encode(g, "w", step))
        assert (a.n, a.index_params, a.index_section, a.value_params, a.value_section) == \
            (b.n, b.index_params, b.index_section, b.value_params, b.value_section)   # all but the config digest
        np.testing.assert_array_equal(plain.memory.residual("w"), decayed.memory.residual("w"))


@pytest.mark.parametrize("decay", [0.95, 0.5])
def test_conservation_with_decay(decay):
    """sum_t beta**(T-t) (g_t - s_t) = e_T: the decayed sum of what was not sent is what is held."""
    pipe = deepreduce.build(_config({"id": "decayed_residual", "decay": decay}))
    rng = np.random.default_rng(1)
    d, beta = 5000, float(np.float32(decay))
    held, bound = np.zeros(d), np.zeros(d)
    for step in range(20):
        g = (rng.laplace(scale=1e-2, size=d) + 1e-3).astype(np.float32)
        sent = pipe.decode(pipe.encode(g, "w", step)).astype(np.float64)
        held = beta * held + g - sent
        residual = pipe.memory.residual("w").astype(np.float64)
        bound = beta * bound + 4 * EPS32 * (np.abs(held) + np.abs(g) + np.abs(sent))
    assert np.abs(residual).max() > 0
    assert np.all(np.abs(residual - held) <= bound + 1e-30)


def test_first_step_is_not_decayed_and_decay_scales_what_is_held():
    mem = registry.create("memory", {"id": "decayed_residual", "decay": 0.5})
    x = np.array([1.0, 2.0, 4.0], np.float32)
    comp = mem.accumulate("t", x)
    np.testing.assert_array_equal(comp.flat, x)
    mem.settle("t", np.array([2]), np.array([4.0], np.float32))
    np.testing.assert_array_equal(mem.compensate("t", x), [1.5, 3.0, 4.0])
    np.testing.assert_array_equal(mem.residual("t"), [1.0, 2.0, 0.0])   # compensate leaves state alone
    comp = mem.accumulate("t", x)
    np.testing.assert_array_equal(comp.flat, [1.5, 3.0, 4.0])


def test_nonfinite_gradient_leaves_the_decayed_state_alone():
    mem = registry.create("memory", {"id": "decayed_residual", "decay": 0.9})
    mem.accumulate("t", np.ones(8, np.float32))
    before = mem.residual("t").copy()
    bad = np.ones(8, np.float32)
    bad[3] = np.inf
    assert not mem.accumulate("t", bad).finite
    np.testing.assert_array_equal(mem.residual("t"), before)


def test_state_dict_round_trip_and_config():
    mem = registry.create("memory", {"id": "decayed_residual", "decay": 0.95})
    mem.accumulate("t", np.arange(4, dtype=np.float32))
    other = registry.create("memory", mem.get_config())
    other.load_state_dict(mem.state_dict())
    np.testing.assert_array_equal(other.residual("t"), mem.residual("t"))
    assert mem.get_config() == {"id": "decayed_residual", "decay": 0.95}
    for bad in (0.0, 1.5, -1.0):
        with pytest.raises(ConfigError, match="decay"):
            registry.create("memory", {"id": "decayed_residual", "decay": bad})


def test_entries_decay_their_sparse_residual():
    pipe = deepreduce.build({"sparsifier": {"id": "topk", "ratio": 0.5}, "index": "raw", "value": "raw",
                             "memory": {"id": "decayed_residual", "decay": 0.5}, "min_numel": 0})
    positions = np.array([1, 5, 9, 20], np.int64)
    encode_entries(pipe, positions, np.array([1.0, 8.0, 2.0, 4.0], np.float32), (32,), name="e", step=0)
    held = pipe.memory._residuals["e"]          # 8 and 4 were sent; 1 and 2 are held
    np.testing.assert_array_equal(held.positions, [1, 9])
    np.testing.assert_array_equal(held.values, [1.0, 2.0])
    payload = encode_entries(pipe, np.array([1], np.int64), np.array([0.25], np.float32), (32,), name="e", step=1)
    got_positions, got_values = decode_entries(pipe, [payload], (32,))
    np.testing.assert_array_equal(got_positions, [9])          # 0.5 * 2 = 1 beats 0.5 * 1 + 0.25
    np.testing.assert_array_equal(got_values, [1.0])           # undecayed it would be 2
    held = pipe.memory._residuals["e"]
    np.testing.assert_array_equal(held.positions, [1])
    np.testing.assert_array_equal(held.values, [0.75])


@pytest.mark.parametrize("config", ["sparseloco", "semisync_topk", "demo_style"])
def test_torch_tensors_give_the_numpy_containers_and_residuals(config):
    """The torch path (selection on the device, the decayed residual a tensor scaled in place)
    sends the bytes the NumPy path sends."""
    import warnings

    import torch
    host, device = deepreduce.build(f"configs/{config}.yaml"), deepreduce.build(f"configs/{config}.yaml")
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # codecs without a device path run on the host
        for step in range(4):
            g = rng.standard_normal(4096 * 5 + 77).astype(np.float32)
            expected = host.encode(g, "w", step)
            got = device.encode(torch.from_numpy(g.copy()), "w", step)
            assert bytes(got.numpy() if isinstance(got, torch.Tensor) else got) == expected.tobytes()
    held = device.memory.residual("w")
    assert isinstance(held, torch.Tensor)
    np.testing.assert_array_equal(held.numpy(), host.memory.residual("w"))


def test_a_size_change_is_refused_before_the_residual_decays():
    from deepreduce.errors import CommunicationError
    mem = registry.create("memory", {"id": "decayed_residual", "decay": 0.5})
    mem.accumulate("t", np.ones(8, np.float32))
    with pytest.raises(CommunicationError, match="keep its size"):
        mem.accumulate("t", np.ones(9, np.float32))
    np.testing.assert_array_equal(mem.residual("t"), np.ones(8))
