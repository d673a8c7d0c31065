"""The DDP hook on 4 real gloo ranks (workers/torch_ddp_four.py): allgather and the sparse
all-reduce agree with DDP's own all-reduce and with each other; a shard whose owner receives
nothing and an uneven split (every selected entry in one shard) work.

Every rank arms a faulthandler watchdog: a hang fails the test with the ranks' stacks on stderr."""
import os
import sys

import numpy as np
import pytest
from conftest import spawn_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import torch_ddp_four as worker  # noqa: E402

RANKS = 4


@pytest.fixture(scope="module")
def ranks():
    """Every rank's results, by scenario name (conftest.spawn_ranks)."""
    return spawn_ranks(worker.run, world=RANKS, timeout=400)


def every(ranks, scenario):
    return [ranks[r][scenario] for r in range(RANKS)]


def test_lossless_hook_equals_ddp_on_four_ranks(ranks):
    for r in every(ranks, "scenario_allgather_and_sparse_allreduce"):
        assert np.abs(r["lossless"] - r["reference"]).max() < 1e-5


@pytest.mark.parametrize("per_parameter", [True, False])
def test_sparse_allreduce_without_reselection_equals_allgather_exactly(ranks, per_parameter):
    results = every(ranks, "scenario_allgather_and_sparse_allreduce")
    for r in results:
        np.testing.assert_array_equal(r[("sparse_allreduce", per_parameter)], r[("allgather", per_parameter)])
        assert not np.array_equal(r[("allgather", per_parameter)], r["reference"])   # Top-r is not dense
        assert r[("stats", "sparse_allreduce", per_parameter)]["aggregation"] == "sparse_allreduce"
    for r in results[1:]:
        np.testing.assert_array_equal(r[("allgather", per_parameter)], results[0][("allgather", per_parameter)])


def test_a_shard_whose_owner_receives_nothing_and_an_uneven_split(ranks):
    results = every(ranks, "scenario_one_shard")
    for r in results:
        live = np.flatnonzero(r["allgather"])
        assert live.size and live.max() < worker.LIVE     # every selected entry lies in shard 0
        np.testing.assert_array_equal(r["even"], r["allgather"])
        np.testing.assert_array_equal(r["repartitioned"], r["allgather"])
        # even shards: the owners of shards 1-3 never received an entry; repartitioned: every
        # boundary moved into the live entries, the last shard spans nearly the whole tensor
        assert r["even_bounds"] == [0, 1000, 2000, 3000, 4000]
        bounds = r["repartitioned_bounds"]
        assert bounds[0] == 0 and bounds[-1] == worker.NUMEL and max(bounds[1:-1]) < worker.LIVE
        lengths = np.diff(bounds)
        assert lengths[-1] > worker.NUMEL - worker.LIVE and lengths[:-1].max() < worker.LIVE
    for r in results[1:]:
        np.testing.assert_array_equal(r["repartitioned"], results[0]["repartitioned"])
        # the owners of the empty shards received container headers only, shard 0's owner entries
        assert r["even_received"]["alltoall"] < results[0]["even_received"]["alltoall"] / 10
