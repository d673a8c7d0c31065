"""Horovod's usage patterns with ``deepreduce.torch.DistributedOptimizer`` on real mpirun ranks
(workers/torch_horovod_patterns.py). A hung rank dumps its stacks and exits (the worker's
watchdog); the launch itself is bounded by ``run_ranks``' timeout."""
import json

import pytest

from conftest import run_ranks


def results(scenario: str, np_: int = 2) -> list:
    out = run_ranks("mpirun", "torch_horovod_patterns.py", scenario, np_=np_, timeout=240).stdout
    found = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(found) == np_, out
    return sorted(found, key=lambda r: r["rank"])


def test_broadcast_optimizer_state_after_resume_on_rank_zero_finishes_and_ranks_agree():
    for rank in results("resume"):
        for kind in ("sgd_momentum", "adam", "adagrad"):
            r = rank[kind]
            assert r["seconds"] < 10, (kind, r)           # Horovod's own takes ~0.1 s; a collective would hang
            assert r["state_agrees"] and r["params_agree"], (kind, r)
            assert r["equals_horovod"], (kind, r)
        assert rank["fresh_params_agree"]


def test_step_after_synchronize_warns_once_and_goes_on():
    for rank in results("synchronize"):
        assert rank["warnings"] == 1 and rank["params_agree"], rank


def test_process_set_members_reduce_and_non_members_apply_their_own_gradient():
    ranks = results("process_set", np_=3)
    assert [r["member"] for r in ranks] == [True, True, False]
    for r in ranks:
        assert r["equals_horovod"], r
    assert ranks[2]["equals_local"] and not ranks[0]["equals_local"]
