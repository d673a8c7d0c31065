"""The DDP communication hook on 2 real gloo ranks (one spawn runs every scenario, see workers/torch_ddp_hook.py)."""
import math
import os
import sys

import numpy as np
import pytest
from conftest import spawn_ranks

from deepreduce.wire import container

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import torch_ddp_hook as worker  # noqa: E402


@pytest.fixture(scope="module")
def ranks():
    """Both ranks' results, by scenario name (conftest.spawn_ranks)."""
    return spawn_ranks(worker.run)


def both(ranks, scenario):
    return ranks[0][scenario], ranks[1][scenario]


def test_lossless_hook_matches_ddp_allreduce_and_ranks_agree(ranks):
    r0, r1 = both(ranks, "scenario_lossless")
    assert r0["max_diff"] < 1e-5 and r1["max_diff"] < 1e-5
    np.testing.assert_array_equal(r0["params"], r1["params"])
    # fp16 codes through all_reduce: close to the float32 result, not equal to it
    assert 0 < r0["fp16_max_diff"] < 1e-2


def test_one_collective_per_bucket_in_steady_state(ranks):
    r0, r1 = both(ranks, "scenario_collectives")
    assert r0["per_step"] == r1["per_step"]
    first, *steady = r0["per_step"]
    # a bucket's first step has no slot yet: its containers come in a second gather
    assert first[0] == 2 * first[1]
    # DDP rebuilds its buckets after the first step; from the third on, one collective each
    for collectives, buckets in steady[1:]:
        assert buckets >= 2 and collectives == buckets, r0["per_step"]
    np.testing.assert_array_equal(r0["params"], r1["params"])


def test_summable_compressor_takes_one_collective_per_bucket_in_steady_state(ranks):
    r0, r1 = both(ranks, "scenario_summable_collectives")
    assert r0["per_step"] == r1["per_step"]
    first, buckets = r0["per_step"][0]
    assert first == 2 * buckets   # a bucket's first step: the header, then the codes
    # after DDP's bucket rebuild (step 1), one all_reduce per bucket carries the codes and the flag
    for collectives, buckets in r0["per_step"][2:5] + r0["per_step"][7:]:
        assert buckets >= 2 and collectives == buckets, r0["per_step"]
    # rank 1's compress of fc1.weight raised at step 5: its flag sends every rank to that bucket's
    # header, whose check fails the step on every rank, naming it; the other buckets were reduced
    # in one collective each, and training went on alike
    assert sorted(r0["errors"]) == sorted(r1["errors"]) == [5]
    assert "rank(s) [1] could not encode" in r0["errors"][5] and "fp16 boom" in r1["errors"][5]
    assert r0["per_step"][5] == (r0["per_step"][4][0] + 1, r0["per_step"][4][1] - 1)
    np.testing.assert_array_equal(r0["params"], r1["params"])


def test_auto_aggregation_plans_each_bucket_alike_on_every_rank(ranks):
    r0, r1 = both(ranks, "scenario_auto")
    for link in ("fast", "slow"):
        a, b = r0[link], r1[link]
        assert a["plan"] == b["plan"] and a["plan"] and a["plans_made"] == 1
        np.testing.assert_array_equal(a["params"], b["params"])
        assert a["losses"][-1] < a["losses"][0] and b["losses"][-1] < b["losses"][0]
        # the table is printed once, by rank 0, with a row per bucket
        assert a["printed"].count("deepreduce auto aggregation") == 1 and not b["printed"]
        assert all(bucket in a["printed"] for bucket in a["plan"])
    # a link far faster than the codecs: every bucket dense; far slower: every bucket compressed
    # (the stated links decide: host_costs off)
    assert set(r0["fast"]["plan"].values()) == {"dense"}
    # a bucket planned dense sent what Top-r had held back: no residual is left
    assert r0["fast"]["residuals_left"] == r1["fast"]["residuals_left"] == 0
    assert r0["slow"]["residuals_left"] > 0
    assert set(r0["slow"]["plan"].values()) <= {"allgather", "sparse_allreduce"}


def test_sparse_allreduce_in_the_hook(ranks):
    for r in both(ranks, "scenario_sparse_allreduce"):
        assert max(r["max_diffs"]) < 1e-5          # the exact union equals DDP's all-reduce
        # per parameter: the step's six tensors in one alltoall per phase (two all_to_all_single each);
        # whole buckets: one container per bucket, and a step of one bucket sends phase two by allgather
        per_parameter, whole = r["alltoalls_per_step"][:3], r["alltoalls_per_step"][3:]
        assert per_parameter == [4, 4, 4] and set(whole) <= {2, 4}, r["alltoalls_per_step"]
        assert r["resumed_equal"] and r["has_owner_state"]


def test_gradiveq_codes_go_through_all_reduce(ranks):
    r0, r1 = both(ranks, "scenario_gradiveq")
    assert r0["compressed"] > 0 and r0["compressed"] == r1["compressed"]   # the conv layer after training
    np.testing.assert_array_equal(r0["params"], r1["params"])
    assert r0["wire_bytes"] == r1["wire_bytes"] > 0


def documented_container_bytes(shape, ratio=0.01, min_numel=1000):
    """docs/container-format.md: header, varints and CRC (container.overhead) plus the sections;
    Top-r with raw codecs sends floor(r d) uint32 indices and float32 values, small tensors dense."""
    numel = math.prod(shape)
    if numel < min_numel:
        return container.overhead(shape, numel, value_bytes=4 * numel) + 4 * numel
    n = max(1, math.floor(ratio * numel))
    return container.overhead(shape, n, index_bytes=4 * n, value_bytes=4 * n) + 8 * n


def test_topk_bytes_on_the_wire_are_the_documented_container_sizes(ranks):
    for result in both(ranks, "scenario_topk_bytes"):
        per_step = sum(documented_container_bytes(s) for s in result["shapes"])
        assert result["steps"] == 3
        assert result["wire_bytes"] == 3 * per_step


def test_device_path_gives_the_host_paths_containers_and_parameters(ranks):
    r0, r1 = both(ranks, "scenario_device_path")
    for result in (r0, r1):
        assert result["params_equal"] and result["containers_equal"]
    np.testing.assert_array_equal(r0["params"], r1["params"])


def test_resumed_state_sends_identical_containers(ranks):
    for result in both(ranks, "scenario_checkpoint"):
        assert len(result["names"]) == 6
        assert result["identical"] and result["params_equal"] and result["step"] == 4
        assert not result["without_state_identical"]   # the saved residuals and stage counts matter


def test_an_unpickled_state_registered_without_bind_trains_on_like_the_original():
    """PyTorch's PowerSGD pickling pattern (workers/torch_ddp_hook.py, scenario_hook_pickling; one
    launch of its own)."""
    r0, r1 = both(spawn_ranks(worker.run_hook_pickling), "scenario_hook_pickling")
    for r in (r0, r1):
        assert r["names"] == ["conv.bias", "conv.weight", "fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
        assert r["lazy_identical"] and r["bound_identical"], r   # the containers of step 3, byte for byte
        np.testing.assert_array_equal(r["lazy"], r["params"])      # as if it was never pickled
        np.testing.assert_array_equal(r["bound"], r["params"])
        assert r["lazy_step"] == 4
        np.testing.assert_array_equal(r["fresh_pickled"], r["unnamed"])
        assert r["fresh_names"] == r["unnamed_names"] == sorted(f"param.{k}" for k in range(6))
        kind, message, _ = r["mismatch"]
        assert kind == "ConfigError" and "position 0 of DDP's hand-over order has shape (3, 4)" in message, message
        assert "'conv.weight' there (16, 3, 3, 3)" in message and "state.bind(" in message, message
    for key in ("params", "lazy", "fresh_pickled"):
        np.testing.assert_array_equal(r0[key], r1[key])   # the ranks agree
    assert r0["mismatch"][1] == r1["mismatch"][1]


def test_warmup_steps_send_dense_containers_and_resume_after_them(ranks):
    for result in both(ranks, "scenario_warmup"):
        assert result["warm"] == [True, True] and result["after"] == [False]
        assert result["resumed"] == [False] and result["fresh"] == [True]


def test_unused_parameters_with_find_unused_parameters(ranks):
    r0, r1 = both(ranks, "scenario_unused")
    assert r0["steps"] == r1["steps"] == 3
    np.testing.assert_array_equal(r0["params"], r1["params"])


def test_nonfinite_gradients_follow_the_pipeline_option(ranks):
    r0, r1 = both(ranks, "scenario_nonfinite")
    assert r0["propagated"] and r1["propagated"]
    # raise: both ranks skip step 1 with the same error (DDP re-raises the hook's failure as a
    # RuntimeError carrying the deepreduce error's class and text), nothing applied, residuals
    # as before; the next step runs and the ranks stay identical
    assert [s for s, _ in r0["skipped"]] == [s for s, _ in r1["skipped"]] == [1]
    assert r0["skipped"][0][1] == r1["skipped"][0][1]
    assert "NonFiniteGradientError: gradient" in r0["skipped"][0][1] and "on rank 1" in r0["skipped"][0][1]
    assert r0["unchanged"] == r1["unchanged"] == [True]
    np.testing.assert_array_equal(r0["params"], r1["params"])
    assert np.isfinite(r0["params"]).all()


def test_a_rank_whose_encode_fails_fails_the_step_on_every_rank(ranks):
    r0, r1 = both(ranks, "scenario_failed_encode")
    assert sorted(r0["errors"]) == sorted(r1["errors"]) == [1, 2]
    assert "boom" in r1["errors"][1]
    assert "CommunicationError" in r0["errors"][1] and "rank 1 could not encode its gradient" in r0["errors"][1]
    assert "ValueError: boom" in r0["errors"][1]
    # a non-finite failure is a NonFiniteGradientError on the peers too (the skip-the-step pattern)
    assert "NonFiniteGradientError" in r0["errors"][2] and "overflowed" in r0["errors"][2]
    np.testing.assert_array_equal(r0["params"], r1["params"])


def test_whole_buckets_send_one_container_for_the_large_gradients(ranks):
    r0, r1 = both(ranks, "scenario_whole_buckets")
    for result in (r0, r1):
        assert result["lossless_equal"]
        # fc1.weight (64 x 576) and branch.weight (10 x 576) in one 1-D container, Top-1% of it
        assert result["merged"] == {"bucket:branch.weight..fc1.weight/2": ((42_624,), 426)} or \
            result["merged"] == {"bucket:fc1.weight..branch.weight/2": ((42_624,), 426)}
        assert "fc1.weight" not in result["others"] and "conv.weight" in result["others"]
    np.testing.assert_array_equal(r0["params"], r1["params"])
    (_, message0, _), (_, message1, _) = r0["mixed"], r1["mixed"]
    assert message0 == message1 and "CommunicationError" in message0 and "whole buckets" in message0


@pytest.mark.parametrize("case, expected", [
    ("error", "rank 0 uses deepreduce config (sparsifier topk"), ("mixed", "rank 1 uses GradiVeQ(")])
def test_rank_disagreement_is_an_error_on_every_rank_within_seconds(ranks, case, expected):
    (_, message0, seconds0), (_, message1, seconds1) = (r[case] for r in both(ranks, "scenario_disagreement"))
    assert message0 == message1 and "CommunicationError" in message0 and expected in message0
    assert max(seconds0, seconds1) < 30


def test_bad_input_gets_clear_errors(ranks):
    for result in both(ranks, "scenario_bad_input"):
        assert result["twice"][0] == "ConfigError" and "already has a communication hook" in result["twice"][1]
        assert result["not_ddp"][0] == "ConfigError" and "got Net" in result["not_ddp"][1]
        assert result["bad_group"][0] == "ConfigError" and "process_group" in result["bad_group"][1]
        assert result["bad_names"][0] == "ConfigError" and "named_parameters" in result["bad_names"][1]
        assert result["bad_config"][0] == "ConfigError" and "nope" in result["bad_config"][1]
        assert result["bad_checkpoint"][0] == "ConfigError" and "state_dict()" in result["bad_checkpoint"][1]


def test_state_needs_an_initialised_process_group():
    from deepreduce.errors import CommunicationError
    from deepreduce.torch.ddp import DeepReduceState

    with pytest.raises(CommunicationError, match="init_process_group"):
        DeepReduceState()
