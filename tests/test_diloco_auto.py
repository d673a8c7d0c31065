"""DiLoCo on 2 real gloo ranks (workers/diloco_auto.py, one spawn): ``sync_every="auto"`` (the
workers measure compute, link and codec, and adopt rank 0's H; issue 33 item 5), the mix
``alpha > 0``, the shipped semi-synchronous configs (``sparseloco``, ``semisync_topk``) with their
decayed error feedback, and ``aggregation: auto`` through the outer loop."""
import os
import sys

import numpy as np
import pytest
from conftest import spawn_ranks

from deepreduce.collective.cost_model import CodecCosts, Link
from deepreduce.collective.sync_period import OuterOption, choose
from deepreduce.errors import ConfigError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import diloco_auto as worker  # noqa: E402


@pytest.fixture(scope="module")
def ranks():
    out = spawn_ranks(worker.run, world=2, timeout=400)
    return [out[r] for r in range(2)]


def every(ranks, scenario):
    return [r[scenario] for r in ranks]


def test_auto_measures_and_every_worker_adopts_the_same_h(ranks):
    results = every(ranks, "scenario_auto_measured")
    first = results[0]
    h = first["stats"]["sync_every"]
    assert h in (2, 4, 8)
    for r in results:
        assert r["before"] == [(None, 0)] * 3               # no outer step while probing
        assert r["chosen"]["sync_every"] == h and r["chosen"]["outer_steps"] == 0
        assert r["chosen"]["sent_bytes"] == 0                 # the probe's collectives are not counted
        assert r["stats"]["sync_period"] == first["stats"]["sync_period"]
        # the first sync at the first multiple of H after the 3 probe steps
        assert [step for step, _ in r["after"]] == [t for t in range(4, 20) if t % h == 0]
        for (_, a), (_, b) in zip(r["after"], first["after"]):
            np.testing.assert_array_equal(a, b)
    decision = first["stats"]["sync_period"]
    assert len(decision["compute_s_per_rank"]) == 2 and decision["compute_s"] == max(decision["compute_s_per_rank"]) > 0
    assert decision["link"]["bandwidth"] > 0 and decision["codec"]["ratio"] == 0.05
    assert decision["option"] == "ag:config" and decision["predicted_step_s"] >= decision["compute_s"]
    assert decision["sent_bits_per_parameter_per_inner_step"] > 0 and decision["parameters"] == 1829


def test_a_slow_link_gets_a_larger_h_than_a_fast_one(ranks):
    for r in every(ranks, "scenario_auto_links"):
        slow, fast = r["slow"], r["fast"]
        assert slow["sync_every"] > fast["sync_every"]
        assert slow["sent_bits_per_parameter_per_inner_step"] < fast["sent_bits_per_parameter_per_inner_step"]
        for decision, link in ((slow, worker.SLOW), (fast, worker.FAST)):   # the model's own choice
            pick = choose([OuterOption("allgather", worker.CODEC)], link, 2, 1829, 0.05, worker.CANDIDATES)
            assert (decision["sync_every"], decision["predicted_step_s"]) == (pick.sync_every, pick.step_s)
            assert Link.from_dict(decision["link"]) == link and CodecCosts.from_dict(decision["codec"]) == worker.CODEC
        assert r["sparse_allreduce"]["option"] == "sa:fixed"
    first, second = every(ranks, "scenario_auto_links")
    assert all(first[k] == second[k] for k in ("slow", "fast", "sparseloco", "sparse_allreduce", "lossless_given"))


def test_auto_prices_a_chunked_config_and_refuses_one_it_cannot_price(ranks):
    r = every(ranks, "scenario_auto_links")[0]
    assert r["sparseloco"]["codec"]["ratio"] == 64 / 4096 and r["sparseloco"]["sync_every"] in worker.CANDIDATES
    assert r["sparseloco"]["codec"]["entry_bytes"] < 4   # 12-bit indices and 2-bit values
    kind, message, _ = r["lossless"]
    assert kind == "ConfigError" and "sparsifier 'none' has none" in message and "auto_inputs" in message
    assert r["lossless_given"]["sync_every"] == r["slow"]["sync_every"]   # with the codec's costs given


def test_resume_keeps_h_without_probing_and_is_byte_identical(ranks):
    for r in every(ranks, "scenario_auto_resume"):
        whole, resumed = r["whole"], r["resumed"]
        assert r["fast_alone"] < whole["sync_every"] == resumed["sync_every"] == 4
        assert resumed["decision"] == resumed["checkpointed"]   # the checkpoint's decision, not a new one
        assert [s for s, _ in whole["after"]] == [4, 8, 12, 16] and [s for s, _ in resumed["after"]] == [8, 12, 16]
        assert resumed["sent"] and whole["sent"][-len(resumed["sent"]):] == resumed["sent"]
        np.testing.assert_array_equal(whole["params"], resumed["params"])
        np.testing.assert_array_equal(whole["globals"], resumed["globals"])
        assert whole["bytes"] == resumed["bytes"]


def test_a_checkpoint_taken_while_probing_resumes_the_probe(ranks):
    for r in every(ranks, "scenario_auto_resume"):
        early = r["while_probing"]
        assert early["checkpointed"] is None
        # the resumed run measured anew (its fast link chooses H = 2 of (2, 3, 4)), probing steps 2-3
        assert early["sync_every"] == 2 and [s for s, _ in early["after"]] == [4, 6, 8, 10]


def test_an_auto_checkpoint_is_refused_where_it_does_not_fit(ranks):
    for r in every(ranks, "scenario_auto_checkpoint_refused"):
        kind, message, _ = r["fixed"]
        assert kind == "ConfigError" and "sync_every='auto'" in message and "H = 4" in message
        kind, message, _ = r["candidate"]
        assert kind == "ConfigError" and "sync_every 7 is not one of auto_candidates [2, 3, 4]" in message
        assert r["loaded"] == (3, 4)


def test_workers_that_disagree_on_auto_fail_together(ranks):
    results = every(ranks, "scenario_auto_disagree")
    for kind, message, seconds in results:
        assert kind == "CommunicationError" and "sync_every=auto" in message and "sync_every=4" in message
        assert seconds < 30
    assert results[0][1] == results[1][1]


@pytest.mark.parametrize("delay", [0, 1])
def test_alpha_mixes_local_and_global_parameters(ranks, delay):
    results = [r[delay] for r in every(ranks, "scenario_alpha")]
    for r in results:
        assert len(r["gaps"]) >= 3
        assert max(r["gaps"]) < 1e-6, r["gaps"]               # theta = 0.3 theta_local + 0.7 theta_global
        assert min(r["moved"]) > 1e-3                           # and theta_local differed from theta_global
    for a, b in zip(results[0]["globals"], results[1]["globals"]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("config", ["sparseloco", "semisync_topk"])
def test_shipped_semisync_configs_keep_workers_identical_and_conserve_with_decay(ranks, config):
    results = [r[config] for r in every(ranks, "scenario_shipped")]
    for r in results:
        assert len(r["after"]) == 6 and r["decay"] == 0.95
        beta = r["decay"]
        held_back = False
        for name, rows in r["records"].items():
            assert len(rows) == 6
            nexts = [before for before, _, _ in rows[1:]] + [r["final"][name]]
            for (before, handed, sent), after in zip(rows, nexts):
                scale = max(1.0, float(np.abs(before).max()), float(np.abs(handed).max()))
                # e_t = beta e_{t-1} + delta_t - sent_t
                assert np.abs(after - (beta * before + handed - sent)).max() <= 1e-5 * scale, name
                if np.abs(before).max() > 0:
                    held_back = True
                    # the decay is there: without it the balance is off by (1 - beta) e_{t-1}
                    assert np.abs(after - (before + handed - sent)).max() > 1e-3 * np.abs(before).max()
        assert held_back   # chunked Top-64 of 4,096 held entries back
        assert 0 < r["stats"]["bits_per_parameter_per_inner_step"] < 32
    for a, b in zip(results[0]["after"], results[1]["after"]):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(results[0]["after"][0], results[0]["after"][-1])


def test_aggregation_auto_through_the_outer_loop(ranks):
    results = every(ranks, "scenario_aggregation_auto")
    for r in results:
        assert r["outer_steps"] == 5 and r["plan"] and set(r["plan"]) == {"fragment.0"}
        assert sum(r["routes"].values()) == 5
    for (s0, a), (s1, b) in zip(results[0]["after"], results[1]["after"]):
        assert s0 == s1
        np.testing.assert_array_equal(a, b)


def test_auto_arguments_are_checked():
    import torch

    from deepreduce.torch import DiLoCo

    model = worker.Wide()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(ConfigError, match="sync_every must be an integer >= 1 or 'auto'"):
        DiLoCo(model, inner, outer, sync_every="sometimes")
    with pytest.raises(ConfigError, match="auto_candidates must be a non-empty sequence"):
        DiLoCo(model, inner, outer, sync_every="auto", auto_candidates=[])
    with pytest.raises(ConfigError, match="no auto_candidates"):
        DiLoCo(model, inner, outer, sync_every="auto", fragments=4, auto_candidates=[1, 2, 3, 8], delay=3)
    with pytest.raises(ConfigError, match="auto_probe_steps"):
        DiLoCo(model, inner, outer, sync_every="auto", auto_probe_steps=0)
    with pytest.raises(ConfigError, match=r"auto_inputs\['link'\] must be a Link"):
        DiLoCo(model, inner, outer, sync_every="auto", auto_inputs={"link": 1e9})
    with pytest.raises(ConfigError, match="auto_inputs must be a dict"):
        DiLoCo(model, inner, outer, sync_every="auto", auto_inputs={"bandwidth": 1e9})
