"""``deepreduce reproduce hsdp``: the node layout, the rows, the recorder's FSDP2 collectives, the
command's train phase on 2 x 2 gloo ranks (table, bytes against the configs, compressor memory)
and, where network namespaces exist, its time phase over the shaped link."""
from __future__ import annotations

import json
import os

import pytest
import torch

from experiments.reproduce import comm_record, hsdp, netns, replay_runs, semisync_link
from experiments.reproduce.common import Result
from experiments.reproduce.hsdp_worker import crosses_nodes, node_of


# ------------------------------------------------------------------ layout and rows
class _TwoRanksTopOne:
    """A replicate all-reduce of two ranks (this one and a fixed peer) that delivers the average
    of what each sends: everything (``lossless``), or only each rank's one largest entry."""

    def __init__(self, peer, lossless):
        self.peer, self.lossless = peer, lossless
        self.reference = torch.zeros_like(peer)   # the peer's copy of the shared aggregate

    def all_reduce(self, module, fsdp_module, group, shard):
        def kept(x):
            if self.lossless:
                return x
            out = torch.zeros_like(x)
            top = x.abs().argmax()
            out[top] = x[top]
            return out
        peer = self.peer - self.reference
        shard.copy_((kept(shard) + kept(peer)) / 2)
        self.reference += shard


def test_the_shared_reference_candidate_sends_differences_and_delivers_the_aggregate():
    from experiments.reproduce.hsdp_worker import shared_reference

    grads = [torch.tensor([1.0, -2.0, 0.5]), torch.tensor([1.5, -1.0, 0.25]), torch.tensor([0.0, 3.0, 1.0])]
    peer = torch.tensor([0.5, 0.0, -1.0])
    handle = _TwoRanksTopOne(peer, lossless=True)
    shared_reference(handle)
    for g in grads:   # lossless: the difference from the last aggregate adds back to the plain average
        shard = g.clone()
        handle.all_reduce("m", None, None, shard)
        torch.testing.assert_close(shard, (g + peer) / 2)
    handle = _TwoRanksTopOne(peer, lossless=False)
    shared_reference(handle)
    delivered = []
    for _ in range(8):   # the same gradients every step
        shard = grads[0].clone()
        handle.all_reduce("m", None, None, shard)
        delivered.append(shard.clone())
    torch.testing.assert_close(delivered[0], torch.tensor([0.0, -1.0, -0.5]))
    torch.testing.assert_close(delivered[1], torch.tensor([0.5, -0.5, -0.5]))   # a difference left, sent later
    # Then it stalls short of the average (0.75, -1, -0.25): each rank's largest difference from
    # the shared aggregate is its own deviation from the average, the two cancel, and the other
    # coordinates are never sent. A per-rank estimate (EF21's) would not stall; docs/fsdp.md.
    for later in delivered[2:]:
        torch.testing.assert_close(later, torch.tensor([0.5, -1.0, -0.5]))


def test_the_ef21_candidate_delivers_each_ranks_estimate_of_its_gradient():
    from experiments.reproduce.hsdp_worker import ef21

    class OneRankTopHalf:   # one rank whose config sends the Top-50% of what it is given
        def all_reduce(self, module, fsdp_module, group, shard):
            kept = torch.zeros_like(shard)
            top = shard.abs().topk(shard.numel() // 2).indices
            kept[top] = shard[top]
            shard.copy_(kept)

    g = torch.linspace(-1.0, 2.0, 3000)
    handle = OneRankTopHalf()
    ef21(handle, 0.5)
    delivered = []
    for _ in range(3):
        shard = g.clone()
        handle.all_reduce("m", None, None, shard)
        delivered.append(shard)
    top = g.abs().topk(1500).indices
    torch.testing.assert_close(delivered[0][top], g[top])   # the larger half first, the rest held back
    assert int((delivered[0] != 0).sum()) == 1500
    torch.testing.assert_close(delivered[1], g)             # then the difference: the whole gradient
    torch.testing.assert_close(delivered[2], g)             # and nothing more once the estimate is exact


def test_nodes_and_what_crosses_them():
    assert [node_of(r, 4) for r in range(4)] == [0, 0, 1, 1]
    assert crosses_nodes({"ranks": [0, 2]}, 4) and crosses_nodes({"ranks": [1, 3]}, 4)
    assert not crosses_nodes({"ranks": [0, 1]}, 4) and not crosses_nodes({"ranks": [2, 3]}, 4)
    assert crosses_nodes({"ranks": None}, 4)                       # the default group spans both nodes
    assert all(not crosses_nodes({"ranks": [a, b]}, 4) for a, b in ([0, 1], [2, 3]))
    assert sorted(r for g in hsdp.GROUPS for r in g) == list(range(hsdp.WORLD))
    assert all(crosses_nodes({"ranks": g}, hsdp.WORLD) for g in hsdp.GROUPS)


def test_rows_budgets_and_bad_options(tmp_path):
    assert hsdp.select(["fsdp_topk"]) == ["hsdp_fp32", "hsdp_bf16", "fsdp_topk"]
    assert hsdp.select(None) == list(hsdp.METHODS)
    with pytest.raises(ValueError, match="unknown method"):
        hsdp.select(["nope"])
    with pytest.raises(ValueError, match="at least 1"):
        hsdp.budget(False, 0)
    assert hsdp.budget(True, 3).steps == 3 and hsdp.budget(True, 3).eval_every == 3
    assert hsdp.FULL.eval_windows % hsdp.WORLD == 0 and hsdp.QUICK.eval_windows % hsdp.WORLD == 0
    assert hsdp.reduces(hsdp.METHODS["hsdp_bf16"]) == "native bfloat16"
    assert hsdp.reduces(hsdp.METHODS["rs_fsdp_topk"]) == "reduce-scatter + replicate"
    resolved = hsdp.resolve(["hsdp_fp32", "fsdp_topk"], Result("x", "x", []), None)
    assert resolved["fsdp_topk"]["config"]["aggregation"]["id"] == "sparse_allreduce"
    qsgd = hsdp.resolve(["lm_qsgd", "lm_qsgd_sra"], Result("x", "x", []), None)
    assert "aggregation" not in qsgd["lm_qsgd"]["config"] and "aggregation" not in qsgd["lm_qsgd_sra"]
    assert qsgd["lm_qsgd_sra"]["config"] == dict(qsgd["lm_qsgd"]["config"], aggregation={"id": "sparse_allreduce"})
    assert hsdp.METHODS["lm_qsgd_sra"]["aggregation"] == "sparse_allreduce"      # the table's spec is left alone
    with pytest.raises(ValueError, match="phase"):
        hsdp.run(str(tmp_path), quick=True, phase="later")
    with pytest.raises(ValueError, match="seed"):
        hsdp.run(str(tmp_path), quick=True, seeds=[])


def test_layouts_of_more_nodes_and_the_candidate_rows(tmp_path):
    assert hsdp.layout(2) == (hsdp.WORLD, hsdp.GROUPS)
    world, groups = hsdp.layout(4)
    assert (world, groups) == (8, [[0, 2, 4, 6], [1, 3, 5, 7]])
    assert [node_of(r, 8, 4) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(crosses_nodes({"ranks": g}, 8, 4) for g in groups)
    assert crosses_nodes({"ranks": [1, 2]}, 8, 4) and not crosses_nodes({"ranks": [1, 2]}, 8)   # 2 nodes of 4
    assert not crosses_nodes({"ranks": [4, 5]}, 8, 4)
    for bad in (1, 0, 2.5, True):
        with pytest.raises(ValueError, match="--nodes"):
            hsdp.layout(bad)
    with pytest.raises(ValueError, match="--phase train"):
        hsdp.run(str(tmp_path), quick=True, nodes=4, phase="all")
    from deepreduce.cli import main as cli_main
    with pytest.raises(SystemExit, match="--nodes takes a whole number"):
        cli_main(["reproduce", "hsdp", "--out", str(tmp_path), "--nodes", "1", "--phase", "train"])
    # Candidates run by name only; their configs are validated; more nodes travel in the row.
    assert not set(hsdp.CANDIDATE_METHODS) & set(hsdp.select(None))
    name = next(iter(hsdp.CANDIDATES))
    assert hsdp.select([name]) == ["hsdp_fp32", "hsdp_bf16", name]
    rows = hsdp.resolve(["hsdp_fp32", name], Result("x", "x", []), None, nodes=4)
    assert rows[name]["nodes"] == rows["hsdp_fp32"]["nodes"] == 4
    assert "nodes" not in hsdp.resolve([name], Result("x", "x", []), None)[name]
    assert rows[name]["config"]["memory"] == hsdp.CANDIDATES[name]["memory"] or \
        rows[name]["config"]["memory"]["id"] == hsdp.CANDIDATES[name]["memory"]["id"]
    from deepreduce.errors import ConfigError
    hsdp.CANDIDATE_METHODS["broken"] = {"kind": "deepreduce", "config": {"sparsifier": "topk"}, "reduce_scatter": False}
    try:
        with pytest.raises(ConfigError):
            hsdp.resolve(["broken"], Result("x", "x", []), None)
    finally:
        del hsdp.CANDIDATE_METHODS["broken"]


def test_hsdp_train_phase_on_four_nodes_quick(tmp_path):
    """--nodes 4: 8 ranks as 4 nodes x 2; HSDP bf16 hands the link the same bytes per rank per step
    as on 2 nodes (its shard is the same), and the replicate groups span 4 nodes."""
    result = hsdp.run(str(tmp_path), quick=True, methods=["fsdp_topk"], steps=2, phase="train", show_progress=False,
                      nodes=4)
    rows = {r["method"]: r for r in result.rows}
    assert list(rows) == ["hsdp_fp32", "hsdp_bf16", "fsdp_topk"]
    assert rows["hsdp_fp32"]["link_B_step"] == 2 * rows["hsdp_bf16"]["link_B_step"]
    assert rows["hsdp_bf16"]["shard_B"] / 2 <= rows["hsdp_bf16"]["link_B_step"] <= 1.02 * rows["hsdp_bf16"]["shard_B"] / 2
    assert 0 < rows["fsdp_topk"]["link_vs_bf16"] < 0.5
    assert result.extra["world"] == 8 and result.extra["groups"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert any("4 nodes x 2 ranks" in n for n in result.notes)


def test_recorder_knows_fsdp2_collectives():
    out, inp = torch.zeros(4), torch.zeros(8)
    assert comm_record.message("reduce_scatter_single", (), {"output": out, "input": inp}, 0, 2) == \
        {"op": "reduce_scatter_single", "bytes_in": 32, "bytes_received": 16}
    gathered = comm_record.message("all_gather_single", (torch.zeros(8), torch.zeros(4)), {}, 1, 2)
    assert gathered == {"op": "all_gather_single", "bytes_in": 16, "bytes_received": 16}


def test_link_groups_must_partition_the_ranks():
    assert semisync_link.own_group(None, 1, 4) == (None, 1, 4)
    with pytest.raises(ValueError, match="partition"):
        semisync_link.own_group(json.dumps([[0, 2], [1]]), 0, 4)


# ------------------------------------------------------------------ the command
QUICK_METHODS = ["lm_topk", "fsdp_topk", "rs_fsdp_topk"]


def _record(out: str, name: str, steps=None) -> dict:
    plan = hsdp.budget(True, steps)
    method = hsdp.resolve([name], Result("x", "x", []), None)[name]
    path = replay_runs.train_path(os.path.join(out, "cache"), name, method, 0, hsdp.WORLD, plan, hsdp.PREFIX)
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def test_hsdp_train_phase_quick(tmp_path):
    out = str(tmp_path)
    result = hsdp.run(out, quick=True, methods=QUICK_METHODS, phase="train", show_progress=False)
    result.write(out)
    rows = {r["method"]: r for r in result.rows}
    assert list(rows) == ["hsdp_fp32", "hsdp_bf16"] + QUICK_METHODS and result.columns == hsdp.COLUMNS
    assert all(r["spread"] == 0.0 for r in result.rows) and rows["hsdp_fp32"]["vs_fp32_pct"] == 0.0
    fp32, bf16 = rows["hsdp_fp32"], rows["hsdp_bf16"]
    # Native HSDP all-reduces each rank's reduced shard across the nodes: fp32 4 bytes per shard
    # element (FSDP pads dim 0 to the shard count), bf16 exactly half of that.
    for rank, extra in enumerate(_record(out, "hsdp_fp32")["extra"]):
        sent = _record(out, "hsdp_fp32")["sent_bytes"][rank] / hsdp.QUICK.steps
        assert extra["shard_bytes"] <= sent <= 1.02 * extra["shard_bytes"]
    assert fp32["link_B_step"] == 2 * bf16["link_B_step"] and bf16["link_vs_bf16"] == 1.0
    assert abs(bf16["final_loss"] - fp32["final_loss"]) < 0.01 * fp32["final_loss"]
    # Top-5% with raw fp32 values: at least 5% of the shard's bytes, well under bf16's dense bytes.
    for name in QUICK_METHODS:
        assert 0.05 * fp32["shard_B"] <= rows[name]["link_B_step"] <= 0.25 * bf16["link_B_step"]
    # The same config on the reduce-scatter shrinks the traffic inside the node, not across it.
    assert rows["rs_fsdp_topk"]["node_B_step"] < 0.5 * rows["fsdp_topk"]["node_B_step"]
    assert rows["fsdp_topk"]["node_B_step"] == fp32["node_B_step"]
    # Persistent compressor memory: none without a residual; the sparse all-reduce's owner
    # residual covers the part of the rank's (padded) shard it owns in the replicate group of 2
    # (half, at even bounds), plus its bounds: within the shard.
    assert fp32["state_B"] == bf16["state_B"] == rows["lm_topk"]["state_B"] == 0
    assert 0.45 * fp32["shard_B"] <= rows["fsdp_topk"]["state_B"] <= 0.55 * fp32["shard_B"]
    assert rows["rs_fsdp_topk"]["state_B"] == rows["fsdp_topk"]["state_B"]   # fsdp_topk's reduce-scatter: none
    # The recorder's inter-node bytes agree with the replicate engine's own counters: one engine
    # step per FSDP module (2 blocks and the root) per training step; a gathering row hands in its
    # containers plus an 8-byte size per gather and, on the first step, the config agreement.
    record = _record(out, "lm_topk")
    modules = hsdp.QUICK.layers + 1
    for rank, stats in enumerate(record["stats"]):
        engine = stats["replicate"]
        assert set(stats) == {"replicate"} and engine["routes_taken"] == {"allgather": engine["steps"]}
        assert engine["steps"] == hsdp.QUICK.steps * modules
        overhead = record["sent_bytes"][rank] - engine["wire_bytes"]
        assert 8 * engine["steps"] <= overhead <= 8 * engine["steps"] + 2048
    assert set(_record(out, "rs_fsdp_topk")["stats"][0]) == {"reduce_scatter", "replicate"}
    assert all(r["t_100mbit"] is None for r in result.rows)
    assert any("no time phase yet" in n for n in result.notes)
    assert any("within 2%" in n for n in result.notes) and any("<= 0.1 of hsdp_bf16" in n for n in result.notes)
    assert result.plots and os.path.getsize(result.plots[0]) > 1000
    with open(os.path.join(out, "hsdp.json"), encoding="utf-8") as handle:
        curves = json.load(handle)["extra"]["curves"]
    assert curves["fsdp_topk"]["step"][-1] == hsdp.QUICK.steps
    again = hsdp.run(out, quick=True, methods=QUICK_METHODS, phase="train", show_progress=False)
    assert again.rows == result.rows                                # cached: nothing retrained


def test_reach_steps_continue_the_baselines_and_recommended_rows(tmp_path):
    """``reach_steps`` trains the baselines and the recommended rows on past the budget; their first
    steps are the equal-token runs' exactly, the table's loss stays at equal tokens, the step to
    HSDP fp32's final loss is read from the longer runs, and other rows are not continued."""
    out = str(tmp_path)
    with pytest.raises(ValueError, match="reach_steps"):
        hsdp.run(out, quick=True, methods=["fsdp_topk"], steps=4, phase="train", reach_steps=4)
    methods = ["lm_topk", "fsdp_topk"]
    equal = hsdp.run(out, quick=True, methods=methods, steps=4, phase="train", show_progress=False)
    result = hsdp.run(out, quick=True, methods=methods, steps=4, phase="train", show_progress=False, reach_steps=8)
    assert [r["final_loss"] for r in result.rows] == [r["final_loss"] for r in equal.rows]
    longer, base = _record(out, "hsdp_fp32", 8), _record(out, "hsdp_fp32", 4)
    assert longer["curve"][-1]["step"] == 8
    first = {p["step"]: p["val_loss"] for p in base["curve"]}
    assert all(p["val_loss"] == first[p["step"]] for p in longer["curve"] if p["step"] in first)
    plan = hsdp.budget(True, 8)
    lm_topk = hsdp.resolve(["lm_topk"], Result("x", "x", []), None)["lm_topk"]
    assert not os.path.exists(replay_runs.train_path(os.path.join(out, "cache"), "lm_topk", lm_topk, 0, hsdp.WORLD,
                                                     plan, hsdp.PREFIX))       # not a row of the time target
    rows = {r["method"]: r for r in result.rows}
    assert rows["hsdp_fp32"]["step_to_fp32"] == 4       # HSDP fp32 first reaches its own final loss at its end
    note = next(n for n in result.notes if "continued to 8 steps" in n)
    assert "fsdp_topk, hsdp_bf16, hsdp_fp32" in note and "at most 0 in validation loss" in note


@pytest.mark.slow
def test_hsdp_time_phase_quick(tmp_path):
    """Where namespaces exist: profile, the replicate groups' messages over the shaped link, combine;
    else the note says why."""
    available, why = netns.namespaces_available()
    out = str(tmp_path)
    before = netns.namespaces_of_ours() if available else set()
    result = hsdp.run(out, quick=True, methods=["fsdp_topk"], steps=4, show_progress=False)
    rows = {r["method"]: r for r in result.rows}
    if not available:
        assert any("time phase SKIPPED" in n and why in n for n in result.notes)
        return
    assert netns.namespaces_of_ours() == before
    with open(hsdp.time_path(os.path.join(out, "cache"), hsdp.budget(True, 4)), encoding="utf-8") as handle:
        timing = json.load(handle)
    assert set(timing["links"]) == {"100mbit", "1gbit"} and all("tbf" in q for q in timing["qdisc"].values())
    assert set(timing["profile"]) == set(rows)
    slow = {(op, b): s for op, b, s in timing["links"]["100mbit"]}
    big = max(slow, key=lambda key: key[1])
    # Both replicate groups all-reduce at once over the one link: the largest message is paced by it.
    assert big[0] == "all_reduce" and slow[big] >= 0.8 * big[1] * 8 / 100e6
    assert rows["hsdp_fp32"]["t_100mbit"] > 0 and rows["hsdp_fp32"]["x_fp32_100mbit"] == 1.0
    assert any("at 100 Mbit/s" in n for n in result.notes)


def test_hsdp_semisync_row_quick(tmp_path):
    """The semi-synchronous row: FSDP inside the nodes, DiLoCo (semisync_1bit) over the replicate
    groups; the quick budget scales H = 5 to 1, so 4 steps are 4 outer steps on each rank's shard.
    Only DiLoCo's reductions cross the link; inside a node FSDP's traffic is native HSDP's; the
    state is what DiLoCo keeps per rank, part by part."""
    name = hsdp.DILOCO
    assert hsdp.reduces(hsdp.METHODS[name]) == "replicate every 5 steps (DiLoCo)"
    resolved = hsdp.resolve([name], Result("x", "x", []), None)[name]
    assert resolved["compression"]["sparsifier"]["id"] == "chunk_topk" and resolved["outer"] == {"lr": 1.2}
    result = hsdp.run(str(tmp_path), quick=True, methods=[name], steps=4, phase="train", show_progress=False)
    rows = {r["method"]: r for r in result.rows}
    assert list(rows) == ["hsdp_fp32", "hsdp_bf16", name]
    row, fp32 = rows[name], rows["hsdp_fp32"]
    assert 0 < row["link_vs_bf16"] < hsdp.BYTES_TARGET
    assert row["node_B_step"] == fp32["node_B_step"]
    plan = hsdp.budget(True, 4)
    path = replay_runs.train_path(os.path.join(str(tmp_path), "cache"), name, resolved, 0, hsdp.WORLD, plan,
                                  hsdp.PREFIX)
    with open(path, encoding="utf-8") as handle:
        record = json.load(handle)
    for stats, extra in zip(record["stats"], record["extra"]):
        assert stats["outer_steps"] == stats["inner_steps"] == 4
        parts = extra["state_parts"]
        assert extra["state_bytes"] == sum(parts.values()) and parts["outer"] == 0   # plain SGD: no state
        # the float32 θ_global of the shard (no Δ is kept once applied), and a float32 accumulator
        # per tensor (min_numel 0)
        assert parts["globals"] == extra["shard_bytes"] and parts["deltas"] == 0
        assert extra["shard_bytes"] <= parts["compressor"] <= extra["shard_bytes"] + 4096
    assert [p["step"] for p in record["curve"]][-1] == 4
    assert any(f"target {name} within 2%" in n for n in result.notes)


def test_diloco_variants_resolve_to_validated_configs(monkeypatch):
    """Every DiLoCo variant resolves: a named compression from configs/, an inline one validated
    (a misspelt codec parameter is refused here, not on the ranks); each syncs every H >= 1 steps."""
    from deepreduce.errors import ConfigError
    names = list(hsdp.DILOCO_VARIANTS)
    resolved = hsdp.resolve(names, Result("x", "x", []), None)
    assert list(resolved) == names
    for name, method in resolved.items():
        assert method["kind"] == "diloco" and method["sync_every"] >= 1, name
        assert {"sparsifier", "index", "value", "memory"} <= set(method["compression"]), name
    assert resolved["hsdp_diloco_fp32_h5"]["compression"]["value"]["id"] == "raw"
    memory = resolved["hsdp_diloco_b2_h2"]["compression"]["memory"]   # validated: its defaults filled in
    assert memory["id"] == "compact_residual" and memory["block"] == 64
    broken = dict(hsdp.DILOCO_VARIANTS["hsdp_diloco_b2_h2"],
                  compression=dict(hsdp.DILOCO_VARIANTS["hsdp_diloco_b2_h2"]["compression"],
                                   value={"id": "binmean", "bitz": 2}))
    monkeypatch.setitem(hsdp.DILOCO_VARIANTS, "broken", broken)
    with pytest.raises(ConfigError, match="bitz"):
        hsdp.resolve(["broken"], Result("x", "x", []), None)
