"""The sparse all-reduce (deepreduce.dist.sparse_allreduce): shard boundaries, bad settings, and
real runs on 2, 4 and 8 ranks (mpirun, mpi4py communicator; 8 marked slow) and 2 and 4 ranks
(horovodrun, Horovod's alltoall): exact equality with the allgather without re-selection, conservation of both
residuals with it, an uneven split, receive volume under 3k entries, and checkpoint resume
(tests/workers/sparse_allreduce.py)."""
import numpy as np
import pytest
from conftest import run_ranks

import deepreduce
from deepreduce.dist.sparse_allreduce import SparseAllreduce, balanced_bounds, even_bounds
from deepreduce.errors import ConfigError

SCENARIOS = ("exact", "conserve", "uneven", "volume", "resume")


def test_even_and_balanced_bounds():
    assert even_bounds(10, 3).tolist() == [0, 3, 6, 10]
    assert even_bounds(0, 2).tolist() == [0, 0, 0]
    assert balanced_bounds(np.array([1, 2, 3, 50, 60, 70, 80, 99]), 100, 4).tolist() == [0, 3, 60, 80, 100]
    assert balanced_bounds(np.array([5]), 100, 4).tolist() == even_bounds(100, 4).tolist()
    # all positions in one place: empty shards, never decreasing
    assert balanced_bounds(np.arange(8), 100, 4).tolist() == [0, 2, 4, 6, 100]


class _OneRank:
    rank, size = 0, 1

    def alltoall(self, payloads, name):
        return list(payloads)

    def allgather(self, payload, name):
        return [payload]


def test_settings_are_checked():
    pipe = deepreduce.build("topk_raw")
    with pytest.raises(ConfigError, match="reselect"):
        SparseAllreduce(pipe, _OneRank(), reselect="random")
    with pytest.raises(ConfigError, match="repartition_every"):
        SparseAllreduce(pipe, _OneRank(), repartition_every=0)
    with pytest.raises(ConfigError, match="needs a 'ratio'"):
        SparseAllreduce(deepreduce.build("none_raw"), _OneRank())
    with pytest.raises(ConfigError, match="owner_residuals"):
        SparseAllreduce(pipe, _OneRank()).load_state_dict({"bounds": {}})


def test_one_rank_delivers_the_selection_and_keeps_the_rest():
    pipe = deepreduce.build("topk_raw")
    g = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    out = SparseAllreduce(pipe, _OneRank()).reduce(g, "w", 0)
    assert np.count_nonzero(out) == 100
    np.testing.assert_allclose(out + pipe.memory.residual("w"), g, rtol=0, atol=1e-6)


def test_warmup_steps_reduce_dense_on_both_phases():
    pipe = deepreduce.build(dict(deepreduce.load_config("topk_raw"), warmup=1))
    reducer = SparseAllreduce(pipe, _OneRank())
    g = np.random.default_rng(1).standard_normal(10_000).astype(np.float32)
    np.testing.assert_array_equal(reducer.reduce(g, "w", 0), g)
    assert not pipe.memory.residual("w").any() and not reducer.state_dict()["owner_residuals"]["w"].any()
    assert np.count_nonzero(reducer.reduce(g, "w", 1)) == 100


@pytest.mark.parametrize("launcher,ranks,kind", [("mpirun", 2, "mpi"), ("mpirun", 4, "mpi"),
                                                 ("horovodrun", 2, "horovod"), ("horovodrun", 4, "horovod"),
                                                 pytest.param("mpirun", 8, "mpi", marks=pytest.mark.slow)])
def test_sparse_allreduce_on_real_ranks(launcher, ranks, kind):
    out = run_ranks(launcher, "sparse_allreduce.py", kind, np_=ranks, timeout=300).stdout
    for scenario in SCENARIOS:
        assert out.count(f"OK {scenario} ") == ranks, (scenario, out[-2000:])


@pytest.mark.parametrize("ranks", [2, 4])
def test_horovod_optimizer_with_sparse_allreduce(ranks):
    """``aggregation: {id: sparse_allreduce}`` in the torch Horovod optimizer: equal to the
    allgather run without re-selection (per tensor and in buckets), trains with it, resumes from
    a checkpoint byte-identically, ranks that disagree on the aggregation fail together, and the
    ``auto`` plan follows the link and is the same on every rank."""
    out = run_ranks("horovodrun", "torch_sparse_allreduce.py", np_=ranks, timeout=600).stdout
    for scenario in ("exact", "trains", "resume", "disagree", "auto"):
        assert out.count(f"OK {scenario} ") == ranks, (scenario, out[-2000:])
