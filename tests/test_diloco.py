"""Semi-synchronous training (deepreduce.torch.DiLoCo, issue 33) on 2 and 4 real gloo ranks
(workers/diloco.py: one spawn runs every scenario; each rank arms a watchdog), and its schedule
(deepreduce.collective.fragments) on its own."""
import os
import sys

import numpy as np
import pytest
from conftest import run_ranks, spawn_ranks

from deepreduce.collective.fragments import Schedule, split
from deepreduce.errors import ConfigError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import diloco as worker  # noqa: E402


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request):
    world = request.param
    out = spawn_ranks(worker.run, world=world, timeout=400)   # one launch: every rank's results
    return [out[r] for r in range(world)]


def every(ranks, scenario):
    return [r[scenario] for r in ranks]


def test_h1_lossless_equals_ddp_step_for_step(ranks):
    for r in every(ranks, "scenario_equals_ddp"):
        assert r["outer_steps"] == 6
        # within float32 rounding: theta - fl(theta - lr*g) is not lr*g (a few ulps per step)
        assert max(r["diffs"]) < 1e-6, r["diffs"]
    first = every(ranks, "scenario_equals_ddp")[0]["globals"]
    for r in every(ranks, "scenario_equals_ddp")[1:]:
        for a, b in zip(first, r["globals"]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("run", ["allgather", "streaming", "sparse_allreduce", "flat_sparse_allreduce"])
def test_every_worker_holds_identical_global_parameters_after_each_outer_step(ranks, run):
    runs = [r[run] for r in every(ranks, "scenario_identical_globals")]
    first = runs[0]
    assert len(first["after"]) >= 3
    for other in runs[1:]:
        assert len(other["after"]) == len(first["after"])
        for (g0, _, f0), (g1, _, f1) in zip(first["after"], other["after"]):
            np.testing.assert_array_equal(g0, g1)
            assert f0 == f1
    assert first["losses"] != runs[1]["losses"]   # the workers saw different data
    bounds = np.cumsum([0] + first["sizes"])
    for r in runs:
        for globals_, params, fragment in r["after"]:   # alpha = 0: the applied fragment takes the globals
            lo, hi = bounds[r["groups"][fragment][0]], bounds[r["groups"][fragment][-1] + 1]
            np.testing.assert_array_equal(globals_[lo:hi], params[lo:hi])
        if "sparse_allreduce" not in run:   # 12 steps of Top-5% re-selected per shard: too few to show progress
            assert np.mean(r["losses"][-3:]) < np.mean(r["losses"][:3])
        assert not np.array_equal(r["after"][0][0], r["after"][-1][0])   # the global parameters moved
        stats = r["stats"]
        assert stats["outer_steps"] == len(r["after"]) and stats["sent_bytes"] > 0 and stats["received_bytes"] > 0
        assert 0 < stats["bits_per_parameter_per_inner_step"] < 32


def test_streaming_applies_fragments_in_turn(ranks):
    r = every(ranks, "scenario_identical_globals")[0]["streaming"]
    assert len(r["groups"]) == 2
    assert [f for _, _, f in r["after"]][:4] == [1, 0, 1, 0]
    # between syncs the fragment not applied keeps each worker's own progress
    others = every(ranks, "scenario_identical_globals")[1]["streaming"]
    assert any(not np.array_equal(a[1], b[1]) for a, b in zip(r["after"], others["after"]))


def test_delta_buffers_are_held_only_while_a_reduction_is_in_flight(ranks):
    """No Δ buffer persists between outer steps: with fragments synced every 2 inner steps
    (H = 4, two fragments) and a delay of 2, a fragment's buffer exists from its sync step until
    it is applied 2 steps later, then is freed (nothing else keeps a reference): of all the
    buffers allocated, only the one of the reduction in flight at the end is alive."""
    for r in every(ranks, "scenario_delta_buffers"):
        assert r["outer_steps"] >= 6
        assert all(sum(held) <= 1 for held in r["held"])          # one fragment in flight at a time
        assert r["held"][1] == [False, True] and r["held"][3] == [True, False]   # steps 2 and 4 sync
        assert r["allocated"] == r["outer_steps"] + 1 >= 7   # one per reduction; the last still in flight
        assert r["alive"] == 1


def test_error_feedback_conserves_the_pseudo_gradients(ranks):
    for r in every(ranks, "scenario_conservation"):
        assert r
        for name, (gap, scale, residual) in r.items():
            assert gap <= 1e-5 * max(scale, 1.0), (name, gap, scale)
        assert any(residual > 0 for _, _, residual in r.values())   # Top-r held entries back


def test_flat_fragments_sum_alike_and_conserve(ranks):
    """``flat=True`` (one container per fragment): a lossless run's global parameters equal the
    per-parameter run's bit for bit (its bytes differ: the fragment is above ``min_numel``, so its
    small tensors no longer go dense), and error feedback is conserved on the fragment's residual."""
    for r in every(ranks, "scenario_flat"):
        assert r["equal"] and min(r["sent"]) > 0 and r["sent"][0] != r["sent"][1]
        assert list(r["conservation"]) == ["fragment.0"]
        for name, (gap, scale, residual) in r["conservation"].items():
            assert gap <= 1e-5 * max(scale, 1.0) and residual > 0, (name, gap, scale, residual)


def test_resume_is_byte_identical(ranks):
    for r in every(ranks, "scenario_resume"):
        whole, resumed = r["whole"], r["resumed"]
        assert resumed["sent"] and whole["sent"][-len(resumed["sent"]):] == resumed["sent"]
        np.testing.assert_array_equal(whole["params"], resumed["params"])
        np.testing.assert_array_equal(whole["globals"], resumed["globals"])
        assert whole["stats"] == resumed["stats"]


def test_a_checkpoint_of_another_schedule_or_model_is_refused(ranks):
    for r in every(ranks, "scenario_checkpoint_refused"):
        assert r["schedule"][0] == "ConfigError" and "schedule" in r["schedule"][1]
        assert r["globals"][0] == "ConfigError" and "'fc1.weight'" in r["globals"][1]
        assert r["pending"][0] == "ConfigError" and "pending" in r["pending"][1]
        assert r["shards"][0] == "ConfigError" and "holds the shards" in r["shards"][1]
        assert r["format2"][0] is None, r["format2"]
        assert r["loaded"] == 4


@pytest.mark.parametrize("case", ["sync_every", "fragments", "delay", "config", "flat", "outer_lr"])
def test_workers_that_disagree_fail_together_before_the_first_outer_step(ranks, case):
    results = every(ranks, "scenario_disagree")
    for r in results:
        kind, message, seconds = r[case]
        assert kind == "CommunicationError", (case, kind, message)
        assert "DiLoCo" in message and "rank 0 uses" in message and seconds < 30
    assert len({r[case][1] for r in results}) == 1   # the same error on every rank
    for r in results[1:]:
        np.testing.assert_array_equal(r["after"], results[0]["after"])


def test_nonfinite_policies(ranks):
    results = every(ranks, "scenario_nonfinite")
    for r in results:
        assert r["propagate"][0] and r["propagate"][1] >= 1
        kind, message, _ = r["raise_error"]
        assert kind == "NonFiniteGradientError" and "rank 1" in message, message
        assert r["raise_state_kept"] == (True, True, True, True)
    for r in results[1:]:
        np.testing.assert_array_equal(r["raise_after"], results[0]["raise_after"])
    assert np.isfinite(results[0]["raise_after"]).all()


def test_nested_ddp_workers():
    """4 ranks as 2 workers of 2-rank DDP groups: the outer loop over a separate group per DDP rank."""
    results = {r: out["scenario_nested"] for r, out in spawn_ranks(worker.run_nested, world=4, timeout=300).items()}
    for r in range(1, 4):
        assert len(results[r]["after"]) == len(results[0]["after"]) == 4
        for a, b in zip(results[0]["after"], results[r]["after"]):
            np.testing.assert_array_equal(a, b)
    for a, b in ((0, 1), (2, 3)):   # DDP keeps a worker's ranks equal
        np.testing.assert_array_equal(results[a]["params"], results[b]["params"])
    assert not np.array_equal(results[0]["params"], results[2]["params"])   # the workers trained apart
    assert np.mean(results[0]["losses"][-3:]) < np.mean(results[0]["losses"][:3])


# ---------------------------------------------------------------------- the schedule alone
@pytest.mark.parametrize("sync_every,fragments", [(1, 1), (4, 3), (6, 2), (10, 4), (7, 7)])
def test_fragments_cover_every_parameter_once_per_cycle(sync_every, fragments):
    sizes = [5, 1200, 48, 300, 7, 900, 64, 64]
    groups = split(sizes, fragments)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
    assert all(g == list(range(g[0], g[-1] + 1)) for g in groups)   # contiguous, in module order
    schedule = Schedule(sync_every, fragments, 0, 0.0)
    for cycle in range(3):
        start = schedule.offsets[-1] + 1 + cycle * sync_every
        synced = [schedule.syncing(t) for t in range(start, start + sync_every)]
        assert sorted(f for f in synced if f is not None) == list(range(fragments))


def test_split_balances_sizes():
    groups = split([100] * 12, 3)
    assert [len(g) for g in groups] == [4, 4, 4]
    assert all(groups) and len(split([1, 1, 10_000], 3)) == 3


@pytest.mark.parametrize("args,match", [
    ((0, 1, 0, 0.0), "sync_every"),
    ((4, 5, 0, 0.0), "fragments=5 exceeds sync_every=4"),
    ((8, 4, 3, 0.0), "delay=3 exceeds 2"),
    ((4, 1, 0, 1.5), "alpha"),
    ((4, 1, -1, 0.0), "delay"),
])
def test_schedule_refuses_bad_arguments(args, match):
    with pytest.raises(ConfigError, match=match):
        Schedule(*args)


def test_split_refuses_more_fragments_than_tensors():
    with pytest.raises(ConfigError, match="fragments=3 but the model has only 2"):
        split([10, 10], 3)


def test_horovod_backend():
    """horovodrun -np 2 (workers/diloco_horovod.py): H = 1 lossless equals SGD on the averaged
    gradient; Top-r, fragments and a delay over allgather and the sparse all-reduce leave every
    rank with identical global parameters; ``sync_every="auto"`` probes over Horovod and both
    ranks adopt one H."""
    out = run_ranks("horovodrun", "diloco_horovod.py", timeout=300)
    assert out.stdout.count("OK") == 2 and out.stdout.count("auto H=") == 2


def test_arguments_are_checked_before_any_collective():
    import torch

    from deepreduce.torch import DiLoCo

    model = worker.Net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(ConfigError, match="outer_optimizer must hold exactly the model's trainable parameters"):
        DiLoCo(model, inner, torch.optim.SGD(model.fc1.parameters(), lr=1.0), sync_every=2)
    with pytest.raises(ConfigError, match="must be two optimizers"):
        DiLoCo(model, inner, inner, sync_every=2)
    with pytest.raises(ConfigError, match="backend must be one of"):
        DiLoCo(model, inner, outer, sync_every=2, backend="nccl")
    with pytest.raises(ConfigError, match="fragments=5 but the model has only 4"):
        DiLoCo(model, inner, outer, sync_every=8, fragments=5)
    with pytest.raises(ConfigError, match="model must be a torch.nn.Module"):
        DiLoCo(object(), inner, outer, sync_every=2)
    with pytest.raises(ConfigError, match="flat must be True or False, got 'yes'"):
        DiLoCo(model, inner, outer, sync_every=2, flat="yes")
