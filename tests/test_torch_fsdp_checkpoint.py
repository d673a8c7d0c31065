"""DCP checkpoints of deepreduce's FSDP comms (deepreduce.torch.fsdp_checkpoint) over real gloo
ranks (workers/torch_fsdp_checkpoint.py).

A run saves model, optimizer and the compression handle with ``dcp.save`` after K steps and trains
M more; fresh processes load the checkpoint and train the same M steps: every container each rank
sends is byte-identical and the parameters are equal, for the reduce-scatter's residuals (1-D
FSDP) and for the replicate sparse all-reduce's owner residuals (HSDP recipe). A load into
another config, world size or rank, or of corrupt bytes, is refused with an error naming it."""
import os
import sys

import numpy as np
import pytest
from conftest import spawn_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import torch_fsdp_checkpoint as worker  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("dcp"))
    saved = spawn_ranks(worker.run_save, directory, world=2, timeout=400)
    resumed = spawn_ranks(worker.run_resume, directory, world=2, timeout=400)
    return directory, saved, resumed


@pytest.mark.parametrize("setting", worker.SETTINGS)
def test_resumed_run_sends_byte_identical_containers(runs, setting):
    _, saved, resumed = runs
    for rank in range(2):
        before = saved[rank]["scenario_save"][setting]
        after = resumed[rank]["scenario_resume"][setting]
        assert len(before["sent"]) >= worker.M and len(before["sent"]) == len(after["sent"])
        for step, (a, b) in enumerate(zip(before["sent"], after["sent"])):
            assert a == b, f"rank {rank}: payload {step} differs after the resume"
        assert np.array_equal(after["params"], before["params"])
        assert after["again"]["sent"] == before["sent"]   # reloaded into built engines: the same bytes
        assert np.array_equal(after["again"]["params"], before["params"])
        assert after["state_bytes"] == before["state_bytes"] > 0
        assert before["keys"] == ["meta", f"rank{rank}"]   # rank-unique: DCP keeps every rank's state


def test_loads_into_another_config_or_of_corrupt_bytes_are_refused(runs):
    _, _, resumed = runs
    for rank in range(2):
        r = resumed[rank]["scenario_resume"]["refused"]
        assert r["config"].startswith("ConfigError") and "another compression config" in r["config"]
        assert r["corrupt"].startswith("ConfigError") and "does not read back" in r["corrupt"]
        assert r["other_rank"].startswith("ConfigError") and f"'rank{rank}'" in r["other_rank"]


@pytest.mark.parametrize("world", [1, 3])
def test_loads_with_another_world_size_are_refused(runs, world):
    directory, _, _ = runs
    results = spawn_ranks(worker.run_world, directory, world=world, timeout=400)
    for rank in range(world):
        r = results[rank]["scenario_world"]
        # the checkpoint's 2 ranks against this run's: refused by deepreduce on every rank
        assert r["partial"].startswith("ConfigError") and "saved by 2 ranks" in r["partial"] \
            and f"this run has {world}" in r["partial"]
        if world == 1:   # the rank's own key is there: deepreduce refuses it
            assert r["strict"] == r["partial"]
        else:            # rank 2 has no key in a 2-rank checkpoint: DCP's strict load names it
            assert r["strict"].startswith("CheckpointException") and "compression.rank2" in r["strict"]
