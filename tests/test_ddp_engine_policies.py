"""The DDP hook's step engine on 2 gloo ranks: both ``nonfinite`` policies and a caught encode
error over every route give one outcome on every route and rank (workers/torch_ddp_engine_policies.py;
the Horovod optimizer's twin is in test_multirank.py)."""
import os
import sys

import pytest
from conftest import spawn_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import torch_ddp_engine_policies as worker  # noqa: E402

CASES = [(route, policy) for route in worker.ROUTES
         for policy in (("propagate",) if route == "summable" else ("propagate", "raise"))]


@pytest.fixture(scope="module")
def ranks():
    return {rank: out["every_route"] for rank, out in spawn_ranks(worker.run, timeout=300).items()}


@pytest.mark.parametrize("route, policy", CASES)
def test_a_nan_gradient_follows_the_policy_on_every_route(ranks, route, policy):
    r0, r1 = (ranks[rank][("nan", route, policy)] for rank in (0, 1))
    for r in (r0, r1):
        assert r["same"] and r["wire_bytes"] > 0, r   # every route's bytes are counted
        if policy == "raise":   # every rank skips the step, nothing applied, residuals as before
            assert r["raised"] and "NonFiniteGradientError" in r["raised"], r
            assert r["unchanged"] and r["residuals_kept"] and not r["nan_applied"], r
            assert r["next"] is None and r["finite_after"], r
        else:                   # the NaN reaches the optimizer, counted in compression_stats()
            assert r["raised"] is None and r["nan_applied"] and r["propagated"] >= 1, r
    assert r0["raised"] == r1["raised"]


@pytest.mark.parametrize("route, policy", CASES)
def test_a_caught_encode_error_fails_the_step_on_every_rank(ranks, route, policy):
    r0, r1 = (ranks[rank][("encode_error", route, policy)] for rank in (0, 1))
    # rank 1 reports its own error; rank 0 a CommunicationError (it raised nothing while encoding)
    assert "ValueError: injected encode failure" in r1["raised"] and "raised while encoding" in r1["raised"], r1
    assert "CommunicationError" in r0["raised"] and "raised while encoding" not in r0["raised"], r0
    for r in (r0, r1):   # nothing applied, residuals as before; the next step runs alike on every rank
        assert r["unchanged"] and r["residuals_kept"] and r["next"] is None and r["finite_after"] and r["same"], r
