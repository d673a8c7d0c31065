"""PyTorch's DDP hook patterns with deepreduce's hook on 2 real gloo ranks (workers/torch_ddp_dropin.py).

Every rank arms a faulthandler watchdog: a hang fails the test with the ranks' stacks on stderr."""
import os
import sys

import pytest
from conftest import spawn_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import torch_ddp_dropin as worker  # noqa: E402


@pytest.fixture(scope="module")
def ranks():
    """Both ranks' results, by scenario name (conftest.spawn_ranks)."""
    return spawn_ranks(worker.run)


def test_hook_state_pickles_and_the_restored_state_trains_on_identically(ranks):
    for rank in (0, 1):
        r = ranks[rank]["scenario_pickle"]
        assert r["equal"], r
        assert r["step"] == r["original_step"] == 4 and r["unpickled_step"] == 2   # resumed at 2, trained 2 more
        assert r["repr"].startswith("DeepReduceState(world_size=2")


def test_sparse_embedding_gradients_through_the_hook_equal_ddps_sparse_all_reduce(ranks):
    for rank in (0, 1):
        r = ranks[rank]["scenario_sparse"]
        for case in ("sparse_adam", "sgd"):
            assert r[case]["grad_equal"] and r[case]["sparse"] == [True, True], (case, r)
        assert r["sparse_adam"]["params_max_diff"] == 0.0, r   # SparseAdam: exactly DDP's training
        assert r["sgd"]["params_max_diff"] < 1e-5, r
        assert r["topk_params_agree"]
