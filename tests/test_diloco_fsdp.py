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


def test_per_rank_checkpoint_resumes_byte_identically(ranks):
    for r in ranks:
        whole, resumed = r["scenario_resume"]["whole"], r["scenario_resume"]["resumed"]
        assert resumed["sent"] and resumed["sent"] == whole["sent"][-len(resumed["sent"]):]
        np.testing.assert_array_equal(resumed["shards"], whole["shards"])
        for a, b in zip(resumed["globals"], whole["globals"]):
            np.testing.assert_array_equal(a, b)
        # the node's other rank's state (another shard of every parameter) is refused, naming it
        kind, message, _ = r["scenario_resume"]["resumed"]["peer"]
        assert kind == "ConfigError" and "holds the shards" in message and "each rank loads the state it saved" in message


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
