"""Horovod's usage patterns with ``deepreduce.torch.DistributedOptimizer`` on real mpirun ranks
(workers/torch_horovod_patterns.py). A hung rank dumps its stacks and exits (the worker's
watchdog); the launch itself is bounded by ``run_ranks``' timeout."""
import json

import pytest
from conftest import run_ranks


def results(tmp_path, scenario: str, np_: int = 2) -> list:
    """Every rank's result of one scenario, by rank (the ranks write them to ``tmp_path``)."""
    run_ranks("mpirun", "torch_horovod_patterns.py", scenario, str(tmp_path), np_=np_, timeout=240)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(np_)]


def test_broadcast_optimizer_state_after_resume_on_rank_zero_finishes_and_ranks_agree(tmp_path):
    for rank in results(tmp_path, "resume"):
        for kind in ("sgd_momentum", "adam", "adagrad"):
            r = rank[kind]
            assert r["seconds"] < 10, (kind, r)           # Horovod's own takes ~0.1 s; a collective would hang
            assert r["state_agrees"] and r["params_agree"], (kind, r)
            assert r["equals_horovod"], (kind, r)
        assert rank["fresh_params_agree"]


def test_step_after_synchronize_warns_once_and_goes_on(tmp_path):
    for rank in results(tmp_path, "synchronize"):
        assert rank["warnings"] == 1 and rank["params_agree"], rank


def test_process_set_members_reduce_and_non_members_apply_their_own_gradient(tmp_path):
    ranks = results(tmp_path, "process_set", np_=3)
    assert [r["member"] for r in ranks] == [True, True, False]
    for r in ranks:
        assert r["equals_horovod"], r
    assert ranks[2]["equals_local"] and not ranks[0]["equals_local"]


def test_sparse_embedding_gradients_travel_as_entries_and_equal_horovods_sparse_allgather(tmp_path):
    for rank in results(tmp_path, "sparse"):
        for case in ("embedding_sparse_adam", "embedding_bag_sgd", "embedding_sgd_sparse_as_dense"):
            r = rank[case]
            assert r["grad_equals_horovod"], (case, r)    # the lossless config reduces exactly as Horovod
            # SparseAdam coalesces its gradient: parameters equal; SGD adds Horovod's uncoalesced
            # entries one by one where ours come summed: equal up to float rounding
            assert r["params_equal_horovod"] if case.endswith("adam") else r["params_max_diff"] < 1e-5, (case, r)
            assert rank[case]["grad_sparse"] == [True, True], (case, rank)   # the layout the optimizer gets
        assert rank["topk_params_agree"] and rank["residual_params_agree"]
        assert 0 < rank["residual_sparse_entries"] < 1000 * 16, rank   # held back, and not a dense table


@pytest.mark.parametrize("kwargs", [{"num_groups": 2}, {"groups": 2}, {"groups": []}])
def test_num_groups_and_groups_are_refused_with_a_clear_error(kwargs):
    import horovod.torch as hvd
    import torch

    import deepreduce.torch as drt
    from deepreduce.collective.buckets import refuse_groups
    from deepreduce.errors import ConfigError

    hvd.init()
    net = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigError, match="num_groups/groups .* bucket_cap_mb"):
        drt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), **kwargs)
    with pytest.raises(ConfigError, match="DistributedGradientTape: num_groups/groups"):
        refuse_groups(kwargs.get("num_groups", 0), kwargs.get("groups"), "DistributedGradientTape")
    refuse_groups(0, None, "defaults pass")
