"""DiLoCo over FSDP2 shards (deepreduce.torch.diloco_shards) on 4 real gloo ranks as 2 nodes x 2
ranks (workers/diloco_fsdp.py: one launch runs every scenario; each rank arms a watchdog, so a hang
fails with the ranks' stacks): FSDP shards inside a node, the outer loop runs over the replicate
groups [0, 2] and [1, 3] on each rank's local shard."""
import os
import sys

import numpy as np
import pytest
from conftest import spawn_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import diloco_fsdp as worker  # noqa: E402

GROUPS = ([0, 2], [1, 3])   # the replicate groups: the same shard on both nodes


@pytest.fixture(scope="module")
def ranks():
    out = spawn_ranks(worker.run, world=4, timeout=240)
    return [out[r] for r in range(4)]


@pytest.mark.parametrize("layout", ["bundled", "flat"])
def test_h1_lossless_equals_native_hsdp_step_for_step(ranks, layout):
    for r in ranks:
        r = r["scenario_equals_native_hsdp"][layout]
        assert r["outer_steps"] == 6
        # within float32 rounding, not bit for bit: the outer step applies θ - (θ - fl(θ - lr·g)),
        # not lr·g (a few ulps per step), as DiLoCo against DDP (tests/test_diloco.py)
        assert max(r["diffs"]) < 1e-6, r["diffs"]
        assert r["moved"] > 1e-3   # the parameters did train


def test_semisync_1bit_replicas_hold_identical_shards_after_each_outer_step(ranks):
    runs = [r["scenario_semisync_1bit"] for r in ranks]
    assert all(len(run["after"]) == 4 for run in runs)   # 20 inner steps, H = 5
    for group in GROUPS:
        first, other = (runs[rank] for rank in group)
        for a, b in zip(first["after"], other["after"]):
            np.testing.assert_array_equal(a["shards"], b["shards"])
            np.testing.assert_array_equal(a["shards"], a["globals"])   # alpha 0: the shard is θ_global
        assert first["losses"] != other["losses"]   # the nodes trained on different data
    for run in runs[1:]:   # the gathered model: identical on both nodes
        for a, b in zip(runs[0]["after"], run["after"]):
            np.testing.assert_array_equal(a["full"], b["full"])
    assert not np.array_equal(runs[0]["after"][0]["full"], runs[0]["after"][-1]["full"])
    for run in runs:
        # a rank's figures count its shard: 1 - 4 bits per element of it per inner step on this
        # tiny model (a tensor smaller than a chunk still sends ceil(32 d / 1024) entries)
        assert run["parameters"] == run["local_numel"] < 1300
        assert run["sent_bytes"] > 0 and 0 < run["bits"] < 4


@pytest.mark.parametrize("how", ["resumed", "dcp"])
def test_checkpoint_resumes_byte_identically(ranks, how):
    """Saved at inner step 4 and loaded into fresh objects, per rank with torch.save ("resumed") or
    model, inner optimizer and DiLoCo together with torch.distributed.checkpoint, one checkpoint per
    node ("dcp": ``DiLoCo.distributed_checkpoint()``, each rank's state under its own key; an
    earlier checkpoint loaded first, so only the last load's check may run): the same containers
    and parameters as the run that never stopped."""
    for r in ranks:
        whole, resumed = r["scenario_resume"]["whole"], r["scenario_resume"][how]
        assert resumed["sent"] and resumed["sent"] == whole["sent"][-len(resumed["sent"]):]
        np.testing.assert_array_equal(resumed["shards"], whole["shards"])
        for a, b in zip(resumed["globals"], whole["globals"]):
            np.testing.assert_array_equal(a, b)


def test_per_rank_checkpoint_of_another_shard_is_refused(ranks):
    for r in ranks:   # the node's other rank's state (another shard of every parameter), naming it
        kind, message, _ = r["scenario_resume"]["resumed"]["peer"]
        assert kind == "ConfigError" and "holds the shards" in message and "each rank loads the state it saved" in message


def test_dcp_checkpoint_of_the_whole_world_is_refused_before_the_next_step(ranks):
    """Saved over the whole world between outer steps, DCP keeps one node's copy of each shard and
    of the inner optimizer's moments: the next inner step raises on every rank, naming the recipe."""
    for r in ranks:
        world = r["scenario_resume"]["dcp_world"]
        kind, message, _ = world["error"]
        assert world["trained"] == 0 and kind == "ConfigError"
        assert "not those saved with the DiLoCo state" in message and "save each node apart" in message
        # DCP spreads the one copy it keeps of each shard over the ranks that hold it: either node may differ
        assert "on worker(s) [1]" in message or "on worker(s) [0, 1]" in message or "on worker(s) [0]" in message


def test_dcp_checkpoint_refuses_another_world_rank_or_corrupt_bytes(ranks):
    for rank, r in enumerate(ranks):
        refused = r["scenario_resume"]["dcp_refused"]
        kind, message, _ = refused["world"]
        assert kind == "ConfigError" and "saved by 8 ranks, this run has 4" in message
        kind, message, _ = refused["key"]
        assert kind == "ConfigError" and f"'rank{rank}'" in message
        kind, message, _ = refused["corrupt"]
        assert kind == "ConfigError" and f"the state of rank {rank} does not read back" in message


def test_unsupported_layouts_are_refused_naming_them(ranks):
    for rank, r in enumerate(ranks):
        r = r["scenario_refusals"]
        kind, message, _ = r["default_group"]
        node = [0, 1] if rank < 2 else [2, 3]
        assert kind == "ConfigError" and "other shards of parameter 'a.weight'" in message
        assert f"ranks {node}" in message and "mesh['replicate'].get_group()" in message
        kind, message, _ = r["native_hsdp"]
        assert kind == "ConfigError" and "Replicate()" in message and "mesh['shard']" in message
        kind, message, _ = r["horovod"]
        assert kind == "ConfigError" and "backend='torch'" in message
