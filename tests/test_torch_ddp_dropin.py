"""PyTorch's DDP hook patterns with deepreduce's hook on 2 real gloo ranks (workers/torch_ddp_dropin.py).

Every rank arms a faulthandler watchdog: a hang fails the test with the ranks' stacks on stderr."""
import os
import sys

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import torch_ddp_dropin as worker  # noqa: E402

SCENARIOS = ["pickle", "sparse"]


@pytest.fixture(scope="module")
def ranks():
    """Both ranks' results by scenario; fails with the exit codes if a rank crashed or hung."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 21000 + os.getpid() % 20000
    procs = [ctx.Process(target=worker.run, args=(rank, 2, port, queue, SCENARIOS)) for rank in range(2)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, result = queue.get(timeout=200)
            results[rank] = result
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    exitcodes = [p.exitcode for p in procs]
    assert exitcodes == [0, 0], f"ranks exited with {exitcodes} (stacks of a hang are on stderr)"
    return results


def test_hook_state_pickles_and_the_restored_state_trains_on_identically(ranks):
    for rank in (0, 1):
        r = ranks[rank]["pickle"]
        assert r["equal"], r
        assert r["step"] == r["original_step"] == 4 and r["unpickled_step"] == 2   # resumed at 2, trained 2 more
        assert r["repr"].startswith("DeepReduceState(world_size=2")


def test_sparse_embedding_gradients_through_the_hook_equal_ddps_sparse_all_reduce(ranks):
    for rank in (0, 1):
        r = ranks[rank]["sparse"]
        for case in ("sparse_adam", "sgd"):
            assert r[case]["grad_equal"] and r[case]["sparse"] == [True, True], (case, r)
        assert r["sparse_adam"]["params_max_diff"] == 0.0, r   # SparseAdam: exactly DDP's training
        assert r["sgd"]["params_max_diff"] < 1e-5, r
        assert r["topk_params_agree"]
