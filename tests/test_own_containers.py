"""A rank adds its own container into decode_sum from what it kept at encode time, without
decoding it, and the sum is bit-identical to decoding it (deepreduce/wire/own_containers.py)."""
import glob
import os

import numpy as np
import pytest

import deepreduce
from deepreduce import CommunicationError, ContainerError

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "*.yaml")))


def gradient(seed, size=6000):
    rng = np.random.default_rng(seed)
    return (rng.laplace(size=size) * (rng.random(size) < 0.4)).astype(np.float32)


def count_decodes(pipe, monkeypatch):
    calls = []
    original = pipe._decode_into
    monkeypatch.setattr(pipe, "_decode_into", lambda c, *a, **k: (calls.append(c), original(c, *a, **k)))
    return calls


@pytest.mark.filterwarnings("ignore::deepreduce.sparsify.basic.DenseGradientWarning")
@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p)[:-5] for p in CONFIGS])
def test_own_container_adds_what_decoding_it_would(path, monkeypatch):
    mine, other, receiver = (deepreduce.build(path) for _ in range(3))
    first = mine.warmup     # sparse containers: the first steps after any dense warm-up
    for step in range(first, first + 2):   # the second step runs with live residuals
        payloads = [mine.encode(gradient(step), name="w", step=step),
                    other.encode(gradient(100 + step), name="w", step=step)]
        calls = count_decodes(mine, monkeypatch)
        total = mine.decode_sum([p.copy() for p in payloads], expected_shape=(6000,))
        assert len(calls) == 1   # only the other rank's container was decoded
        expected = receiver.decode_sum(payloads, expected_shape=(6000,))
        np.testing.assert_array_equal(total.view(np.uint32), expected.view(np.uint32))


def test_a_changed_copy_of_the_own_container_is_decoded_and_checked(monkeypatch):
    pipe = deepreduce.build("configs/topk_raw.yaml")
    payload = pipe.encode(gradient(0), name="w")
    damaged = payload.copy()
    damaged[-10] ^= 1
    calls = count_decodes(pipe, monkeypatch)
    with pytest.raises(ContainerError, match="checksum"):
        pipe.decode_sum([payload, damaged])
    assert len(calls) == 0   # the intact own container matched; the damaged one was parsed and refused


def test_own_container_still_checks_the_expected_shape_and_out():
    pipe = deepreduce.build("configs/topk_raw.yaml")
    payload = pipe.encode(gradient(0), name="w")
    with pytest.raises(CommunicationError, match="expected"):
        pipe.decode_sum([payload], expected_shape=(3000, 2))
    for shape in ([3000, 2], np.array([3000, 2]), (6000, 1)):   # any sequence, as for other ranks' containers
        with pytest.raises(CommunicationError, match="expected"):
            pipe.decode_sum([payload], expected_shape=shape)
    for shape in ([6000], np.array([6000]), (np.int64(6000),)):
        assert pipe.decode_sum([payload], expected_shape=shape).shape == (6000,)
    with pytest.raises(CommunicationError, match="out="):
        pipe.decode_sum([payload], out=np.zeros(10, np.float32))
    out = np.full(6000, 7.0, np.float32)   # out= is overwritten, not added to
    np.testing.assert_array_equal(pipe.decode_sum([payload], out=out), deepreduce.build("configs/topk_raw.yaml").decode(payload))


def test_only_the_last_container_of_a_name_is_kept(monkeypatch):
    pipe = deepreduce.build("configs/topk_raw.yaml")
    first = pipe.encode(gradient(0), name="w", step=0)
    pipe.encode(gradient(1), name="w", step=1)
    calls = count_decodes(pipe, monkeypatch)
    pipe.decode_sum([first])
    assert len(calls) == 1 and len(pipe._own._by_key) == 1


def test_a_collective_step_drops_its_own_containers_when_it_ends(monkeypatch):
    """Between steps a pipeline keeps no copy of its containers: the step's sums are done (memory
    a sharded model budgets); within the step its own container is still added without decoding."""
    for end in ("commit_step", "undo_step"):
        pipe = deepreduce.build("configs/topk_raw.yaml")
        pipe.collective_steps()
        payload = pipe.encode(gradient(0), name="w", step=0)
        calls = count_decodes(pipe, monkeypatch)
        pipe.decode_sum([payload])
        assert calls == [] and len(pipe._own._by_key) == 1
        getattr(pipe, end)()
        assert not pipe._own._by_key and not pipe._own._key_of_name
        pipe.decode_sum([payload])       # still decodes, the slow way
        assert len(calls) == 1
