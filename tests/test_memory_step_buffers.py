"""A journaled step writes the residual out of place, so undoing it needs no copy.

Under ``Pipeline.collective_steps`` the journal's snapshot of a residual is the residual array
itself; the memory then writes that step's compensation into a second buffer (``prior +
gradient``, the same pass as the in-place add) and recycles the two buffers from step to step.
These tests check that the out-of-place writes give bit for bit what the in-place ones give
(NumPy and C++ kernels, torch tensors, the C++ shard encode), that an undone step leaves the
residual exactly as it was, and that steady journaled steps allocate nothing new.
"""
import numpy as np
import pytest
import torch

import deepreduce
from deepreduce.backend import kernels, native_pipeline
from deepreduce.collective.shards import encode_shards

CONFIG = {"sparsifier": {"id": "topk", "ratio": 0.01}, "index": "elias_fano", "value": "raw",
          "memory": "residual"}


def _gradients(numel, steps, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(numel) * 0.01).astype(np.float32) for _ in range(steps)]


@pytest.mark.parametrize("topk", [0, 300])
@pytest.mark.parametrize("native", [True, False], ids=["cpp", "numpy"])
def test_scan_out_of_place_equals_in_place_and_leaves_prior_alone(native, topk, monkeypatch):
    if not native:
        monkeypatch.setattr(kernels, "native", lambda: None)
    g, r = _gradients(40000, 2)
    prior, in_place, target = r.copy(), r.copy(), np.full_like(r, np.nan)
    expected = kernels.scan(g, in_place, topk, 1)
    got = kernels.scan(g, target, topk, 1, prior=prior)
    assert got[0] and expected[0]
    np.testing.assert_array_equal(target, in_place)
    np.testing.assert_array_equal(prior, r)
    if topk:
        np.testing.assert_array_equal(got[1], expected[1])


@pytest.mark.parametrize("native", [True, False], ids=["cpp", "numpy"])
def test_a_refused_gradient_leaves_prior_in_the_target_exactly(native, monkeypatch):
    if not native:
        monkeypatch.setattr(kernels, "native", lambda: None)
    g, r = _gradients(20000, 2)
    g[7777] = np.nan
    target = np.zeros_like(r)
    finite, selected = kernels.scan(g, target, 100, 1, prior=r)
    assert not finite and selected is None
    np.testing.assert_array_equal(target, r)


def test_scan_refuses_prior_without_a_residual_or_of_another_size():
    g, r = _gradients(100, 2)
    module = kernels.native()
    assert module is not None
    with pytest.raises(ValueError, match="prior needs a residual"):
        module.scan(g, None, 0, 1, r)
    with pytest.raises(ValueError, match="prior and gradient differ in size"):
        module.scan(g, r.copy(), 0, 1, r[:50])
    with pytest.raises(ValueError, match="one array"):
        module.scan(g, r, 0, 1, r)


def test_torch_residual_out_of_place():
    g, r = (torch.from_numpy(a) for a in _gradients(5000, 2))
    prior, target = r.clone(), torch.empty_like(r)
    assert kernels.scan(g, target, 0, 1, prior=prior) == (True, None)
    torch.testing.assert_close(target, r + g, rtol=0, atol=0)
    torch.testing.assert_close(prior, r, rtol=0, atol=0)


def _journaled(config=CONFIG):
    pipe = deepreduce.build(config)
    pipe.collective_steps()
    return pipe


@pytest.mark.parametrize("memory", ["residual", {"id": "decayed_residual", "decay": 0.9}])
def test_journaled_steps_encode_what_unjournaled_ones_do_and_undo_exactly(memory):
    cfg = dict(CONFIG, memory=memory)
    plain, journaled = deepreduce.build(cfg), _journaled(cfg)
    grads = _gradients(30000, 6, seed=3)
    for step, g in enumerate(grads[:4]):
        assert np.array_equal(plain.encode(g, "w", step), journaled.encode(g, "w", step))
        plain.commit_step()
        journaled.commit_step()
        np.testing.assert_array_equal(plain.memory.residual("w"), journaled.memory.residual("w"))
    before = journaled.memory.residual("w").copy()
    journaled.encode(grads[4], "w", 4)
    assert not np.array_equal(journaled.memory.residual("w"), before)
    journaled.undo_step()
    np.testing.assert_array_equal(journaled.memory.residual("w"), before)   # exact, no rounding
    assert np.array_equal(plain.encode(grads[5], "w", 4), journaled.encode(grads[5], "w", 4))


def test_steady_journaled_steps_alternate_between_two_buffers():
    """Also across a refused (NaN) step: its unused second buffer is kept for the next one."""
    pipe = _journaled()
    seen = set()
    for step, g in enumerate(_gradients(30000, 8, seed=5)):
        if step == 4:
            g[10] = np.nan
        pipe.encode(g, "w", step)
        pipe.commit_step()
        seen.add(id(pipe.memory.residual("w")))
    assert len(seen) == 2


def test_undo_after_settle_and_take_restores_the_residual():
    pipe = _journaled()
    g1, g2 = _gradients(30000, 2, seed=9)
    pipe.encode(g1, "w", 0)
    pipe.commit_step()
    before = pipe.memory.residual("w").copy()
    pipe.save_state("w")
    taken = pipe.memory.take("w")        # the auto plan's flush, inside a journaled step
    np.testing.assert_array_equal(taken, before)
    assert not pipe.memory.residual("w").any()
    pipe.undo_step()
    np.testing.assert_array_equal(pipe.memory.residual("w"), before)
    pipe.encode(g2, "w", 1)
    pipe.undo_step()
    np.testing.assert_array_equal(pipe.memory.residual("w"), before)


@pytest.mark.parametrize("native", [True, False], ids=["cpp", "numpy"])
def test_journaled_shard_encodes_match_in_place_ones(native, monkeypatch):
    if not native:
        monkeypatch.setattr(native_pipeline, "module", lambda: None)
    plain, journaled = deepreduce.build(CONFIG), _journaled()
    assert (journaled.native is not None) == native
    bounds = [0, 7000, 20000, 30000]
    grads = _gradients(30000, 5, seed=4)
    for step, g in enumerate(grads[:4]):
        for a, b in zip(encode_shards(plain, g, "w", step, bounds), encode_shards(journaled, g, "w", step, bounds)):
            assert np.array_equal(a, b)
        plain.commit_step()
        journaled.commit_step()
    before = journaled.memory.residual("w").copy()
    encode_shards(journaled, grads[4], "w", 4, bounds)
    journaled.undo_step()
    np.testing.assert_array_equal(journaled.memory.residual("w"), before)


def test_without_spare_buffers_a_committed_step_holds_one_buffer():
    """``collective_steps(spare_buffers=False)`` (FSDP, DiLoCo): the step's second buffer is
    allocated per step and the old residual freed at commit, so between steps a tensor holds one
    residual, and an undone step still restores it exactly."""
    pipe = deepreduce.build(CONFIG)
    pipe.collective_steps(spare_buffers=False)
    grads = _gradients(30000, 4, seed=6)
    for step, g in enumerate(grads[:3]):
        pipe.encode(g, "w", step)
        pipe.commit_step()
        assert not pipe.memory._spares
    before = pipe.memory.residual("w").copy()
    pipe.encode(grads[3], "w", 3)
    pipe.undo_step()
    np.testing.assert_array_equal(pipe.memory.residual("w"), before)
    assert not pipe.memory._spares
