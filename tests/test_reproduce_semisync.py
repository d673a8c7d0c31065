"""``deepreduce reproduce semisync``: the replay arithmetic, the message recorder, the launcher's
namespace layout, and the command's train phase (and, where namespaces exist, its time phase)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from experiments.reproduce import comm_record, netns, semisync
from experiments.reproduce import semisync_methods as sm
from experiments.reproduce import semisync_replay as rp
from experiments.reproduce.common import Result


# ------------------------------------------------------------------ replay arithmetic
def _rank(rank, steps, method="m"):
    return {"rank": rank, "method": method, "parameters": 100, "curve": [{"step": 0, "val_loss": 9.0}],
            "steps": steps, "stats": {}}


def test_merge_ranks_takes_the_largest_message_and_sums_each_rank():
    r0 = _rank(0, [[["all_gather", 8, 8], ["all_gather", 100, 100]], []])
    r1 = _rank(1, [[["all_gather", 8, 8], ["all_gather", 120, 100]], []])
    merged = rp.merge_ranks([r1, r0])
    assert merged["messages"] == [[["all_gather", 8], ["all_gather", 120]], []]
    assert merged["sent_bytes"] == [108, 128] and merged["received_bytes"] == [108, 108]
    assert merged["outer_steps"] == 1 and merged["steps"] == 2 and merged["world"] == 2
    with pytest.raises(ValueError, match="different numbers of steps"):
        rp.merge_ranks([r0, _rank(1, [[]])])


def test_representatives_keep_both_ends():
    assert rp.representatives([5, 1, 5, 3], 6) == [1, 3, 5]
    picked = rp.representatives(list(range(100, 200)), 6)
    assert len(picked) == 6 and picked[0] == 100 and picked[-1] == 199 and picked == sorted(picked)


def test_transfer_is_exact_at_measured_sizes_and_linear_between():
    transfer = rp.Transfer([["all_reduce", 100, 1.0], ["all_reduce", 300, 3.0], ["all_gather", 10, 0.5]])
    assert transfer.seconds("all_reduce", 100) == 1.0 and transfer.seconds("all_reduce", 200) == pytest.approx(2.0)
    assert transfer.seconds("all_reduce", 500) == pytest.approx(5.0)          # the last segment's slope
    assert transfer.seconds("all_gather", 20) == pytest.approx(1.0)           # one point: proportional
    assert transfer.step([["all_reduce", 100], ["all_gather", 10]]) == pytest.approx(1.5)
    with pytest.raises(KeyError, match="broadcast"):
        transfer.seconds("broadcast", 1)


def test_wall_clock_blocking_and_overlapped():
    transfer = rp.Transfer([["all_reduce", 10, 5.0]])
    compute = {"plain": 1.0, "synced": 2.0}
    messages = [[], [["all_reduce", 10]], [], [], []]
    # Blocking: step 2 computes 2 s then waits 5 s for its message.
    assert rp.wall_clock(messages, compute, transfer) == [1.0, 8.0, 9.0, 10.0, 11.0]
    # Delay 2: the message leaves at 3 s, arrives at 8 s; step 4 (due) waits for it.
    assert rp.wall_clock(messages, compute, transfer, delay=2) == [1.0, 3.0, 4.0, 8.0, 9.0]
    # Two messages back to back share the link: the second starts when the first is through.
    assert rp.wall_clock([[["all_reduce", 10]], [["all_reduce", 10]], []], compute, transfer,
                         delay=1) == [2.0, 7.0, 12.0]


def test_time_to_reach_compute_times_and_spread():
    curve = [{"step": 0, "val_loss": 9.0}, {"step": 2, "val_loss": 5.0}, {"step": 4, "val_loss": 4.0}]
    assert rp.time_to_reach(curve, [1.0, 2.0, 3.0, 4.0], 5.0) == 2.0
    assert rp.time_to_reach(curve, [1.0, 2.0, 3.0, 4.0], 3.0) is None
    assert rp.compute_times([[1.0, False], [3.0, True], [2.0, False]]) == {"plain": 1.5, "synced": 3.0}
    assert rp.compute_times([[2.0, True]]) == {"plain": 2.0, "synced": 2.0}
    assert rp.mean_spread([1.0, 3.0]) == (2.0, 1.0)
    assert rp.bits_per_parameter_step(100, 25, 4) == 8.0


# ------------------------------------------------------------------ what the recorder sees
def test_message_sizes_of_each_collective():
    t = torch.zeros(10, dtype=torch.float32)
    assert comm_record.message("all_reduce", (t,), {}, 0, 4) == {"op": "all_reduce", "bytes_in": 40,
                                                                  "bytes_received": 40}
    gathered = comm_record.message("all_gather", ([torch.zeros(10)] * 4, t), {}, 1, 4)
    assert gathered["bytes_in"] == 40 and gathered["bytes_received"] == 120
    into = comm_record.message("all_gather_into_tensor", (torch.zeros(40), t), {}, 1, 4)
    assert into["bytes_received"] == 120
    a2a = comm_record.message("all_to_all_single", (torch.zeros(6, dtype=torch.uint8),
                                                    torch.zeros(9, dtype=torch.uint8)),
                              {"output_split_sizes": [1, 2, 3], "input_split_sizes": [2, 3, 4]}, 1, 3)
    assert a2a == {"op": "all_to_all_single", "bytes_in": 6, "bytes_received": 4}
    root = comm_record.message("broadcast", (t,), {"src": 0}, 0, 2)
    leaf = comm_record.message("broadcast", (t,), {"src": 0}, 1, 2)
    assert (root["bytes_in"], root["bytes_received"], leaf["bytes_in"], leaf["bytes_received"]) == (40, 0, 0, 40)
    with pytest.raises(ValueError, match="barrier"):
        comm_record.message("barrier", (), {}, 0, 2)


def test_recorder_restores_torch_distributed():
    import torch.distributed as dist

    original = dist.all_reduce
    recorder = comm_record.CollectiveRecorder().install()
    assert dist.all_reduce is not original and dist.all_reduce.__wrapped__ is original
    recorder.uninstall()
    assert dist.all_reduce is original
    assert comm_record.totals([{"bytes_in": 3, "bytes_received": 5}, {"bytes_in": 1, "bytes_received": 0}]) == \
        {"sent": 4, "received": 5}


def test_recorder_keeps_a_background_reduction_made_between_steps():
    """A streaming DiLoCo row's reduction runs on the engine's thread and may finish while the
    harness is not recording (between steps, during evaluation): it is still the training's."""
    import threading

    import torch.distributed as dist

    from experiments.processes import rendezvous_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{rendezvous_port()}", rank=0, world_size=1)
    recorder = comm_record.CollectiveRecorder().install()
    try:
        dist.all_reduce(torch.zeros(3))                        # the harness's own, not recording
        worker = threading.Thread(target=dist.all_reduce, args=(torch.zeros(5),))
        worker.start()
        worker.join()
        recorder.recording = True
        dist.all_reduce(torch.zeros(7))                        # the step's own
        assert [c["bytes_in"] for c in recorder.take()] == [20, 28] and recorder.take() == []
    finally:
        recorder.uninstall()
        dist.destroy_process_group()


def test_a_streaming_row_is_evaluated_on_the_global_parameters():
    from types import SimpleNamespace

    from experiments.reproduce.semisync_worker import global_view

    weight = torch.nn.Parameter(torch.ones(3))
    diloco = SimpleNamespace(named=[("w", weight)], globals=[torch.full((3,), 5.0)])
    streaming = SimpleNamespace(diloco=diloco, method={"fragments": 2, "delay": 1})
    with global_view(streaming):
        assert weight.tolist() == [5.0] * 3
    assert weight.tolist() == [1.0] * 3 and diloco.globals[0].tolist() == [5.0] * 3
    for method in ({"fragments": 1, "delay": 0}, {}):                 # every worker holds θ_global there
        with global_view(SimpleNamespace(diloco=diloco, method=method)):
            assert weight.tolist() == [1.0] * 3
    with global_view(SimpleNamespace(method={"fragments": 2})):       # a row without DiLoCo
        pass


def test_ranks_share_namespaces_in_blocks():
    assert [netns.namespace_of(r, 2) for r in range(4)] == [0, 0, 1, 1]
    assert [netns.namespace_of(r, 1) for r in range(2)] == [0, 1]
    with pytest.raises(ValueError, match="rank 4 needs namespace 2"):
        netns.namespace_of(4, 2)
    with pytest.raises(ValueError, match="at least 1"):
        netns.namespace_of(0, 0)


# ------------------------------------------------------------------ methods and budgets
def test_evaluation_steps_fall_on_outer_steps():
    plan = sm.FULL
    assert sm.eval_steps(sm.METHODS["ddp_fp32"], plan)[:3] == [30, 60, 90]
    assert sm.eval_steps(sm.METHODS["diloco_h100_fp32"], plan) == list(range(100, 901, 100))
    h30 = sm.eval_steps(sm.METHODS["semisync_h30"], plan)
    assert all(s % 30 == 0 for s in h30) and h30[-1] == plan.steps and plan.steps // 30 >= 30
    assert sm.sync_every(sm.METHODS["diloco_h30_int8"], sm.QUICK) == 3
    with pytest.raises(ValueError, match="unknown method"):
        sm.select(["nope"])
    assert sm.select(["semisync_h30"]) == ["ddp_fp32", "semisync_h30"]
    with pytest.raises(ValueError, match="at least 1"):
        sm.budget(False, 0)


def test_outer_optimizer_is_a_name_or_its_own_settings():
    assert sm.outer_sgd("average") == {"lr": 1.0}
    assert sm.outer_sgd("nesterov") == {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    assert sm.outer_sgd(sm.NESTEROV_05) == {"lr": 1.0, "momentum": 0.5, "nesterov": True}
    sm.outer_sgd("average")["lr"] = 9.0                      # a copy: the table's settings stay
    assert sm.OUTER_LR["average"] == {"lr": 1.0}
    with pytest.raises(ValueError, match="unknown outer optimizer 'adam'"):
        sm.outer_sgd("adam")
    with pytest.raises(ValueError, match="needs 'lr'.*'betas'"):
        sm.outer_sgd({"lr": 1.0, "betas": (0.9, 0.99)})
    with pytest.raises(ValueError, match="needs 'lr'"):
        sm.outer_sgd({"momentum": 0.5})


def test_sweep_rows_run_only_when_named():
    assert not set(sm.SWEEP) & set(sm.METHODS) and set(sm.select(None)) == set(sm.METHODS)
    name = next(iter(sm.SWEEP))
    assert sm.select([name, "semisync_h30"]) == ["ddp_fp32", "semisync_h30", name]
    assert sm.spec(name) is sm.SWEEP[name] and sm.spec("ddp_fp32") is sm.METHODS["ddp_fp32"]
    with pytest.raises(ValueError, match="sweep's"):
        sm.select(["nope"])


def test_a_sweep_config_resolves_as_the_shipped_config_of_its_parameters(tmp_path):
    """A row written as a dict resolves to what ``configs/NAME.yaml`` of the same parameters
    loads to, so a config shipped from the sweep reuses the sweep's cached runs."""
    (tmp_path / "dense.yaml").write_text("sparsifier: {id: chunk_topk, chunk: 4096, k: 256}\n"
                                         "index: {id: chunk_enum, chunk: 4096}\nvalue: {id: binmean, bits: 2}\n"
                                         "memory: {id: decayed_residual, decay: 0.95}\n")
    written = semisync.named_config("dense", Result("x", "x", []), str(tmp_path))
    sm.SWEEP["_probe"] = sm._diloco(30, sm.chunked(4096, 256, 2), outer="average")
    try:
        resolved = semisync.resolve(["_probe"], Result("x", "x", []), None)["_probe"]
    finally:
        del sm.SWEEP["_probe"]
    assert resolved["compression"] == written and sm.SWEEP.get("_probe") is None


def test_shipped_1bit_row_is_the_sweep_row_it_came_from():
    """``semisync_1bit_h5`` (configs/semisync_1bit.yaml at H = 5, outer lr 1.2) is the sweep's
    ``sweep_h5_c1k_k32_b1_m0_lr12`` method for method, min_numel 0 included; a sweep row states
    min_numel only when it is given, so the earlier rows' specs (and cached runs) stay as they were."""
    shipped, swept = "semisync_1bit_h5", "sweep_h5_c1k_k32_b1_m0_lr12"
    resolved = semisync.resolve([shipped, swept], Result("x", "x", []), None)
    assert resolved[shipped] == resolved[swept] and shipped in sm.SHIPPED_SEMISYNC
    assert resolved[shipped]["compression"]["min_numel"] == 0 and resolved[shipped]["compression"]["value"]["bits"] == 1
    assert sm.outer_sgd(resolved[shipped]["outer"]) == {"lr": 1.2}
    assert "min_numel" not in sm.chunked(1024, 48, 2) and sm.chunked(1024, 32, 1, min_numel=0)["min_numel"] == 0
    # the table's DiLoCo rows end on an outer step, where every worker holds the global parameters
    assert all(sm.FULL.steps % m["sync_every"] == 0 for m in sm.METHODS.values() if m["kind"] == "diloco")


def test_bad_options_are_named(tmp_path):
    with pytest.raises(ValueError, match="phase"):
        semisync.run(str(tmp_path), quick=True, phase="later")
    with pytest.raises(ValueError, match="even"):
        semisync.run(str(tmp_path), quick=True, workers=[3])


# ------------------------------------------------------------------ the command
QUICK_METHODS = ["ddp_fp16", "lm_topk", "diloco_h30_fp32", "diloco_h30_int8", "sparseloco_h30", "semisync_h30",
                 "semisync_h30_sra"]


def _record(out, name, plan, world=2):
    method = semisync.resolve([name], Result("x", "x", []), None)[name]
    with open(semisync.train_path(os.path.join(out, "cache"), name, method, 0, world, plan), encoding="utf-8") as handle:
        return json.load(handle)


def test_semisync_train_phase_quick(tmp_path):
    out = str(tmp_path)
    result = semisync.run(out, quick=True, methods=QUICK_METHODS, phase="train", show_progress=False)
    result.write(out)
    rows = {r["method"]: r for r in result.rows}
    assert list(rows) == ["ddp_fp32"] + QUICK_METHODS and set(result.columns) >= {"final_loss", "sent_bppis"}
    assert all(r["workers"] == 2 and r["spread"] == 0.0 for r in result.rows)      # one seed in quick
    plan = sm.QUICK
    # Bytes follow the configs: fp32 all-reduce 32 bits per parameter per step, fp16 16, DiLoCo's
    # fp32 all-reduce 32 bits per outer step (H = 3 in quick: 4 of 12 steps), plus the one float32
    # failure flag the engine's dense route appends to each all-reduce.
    assert rows["ddp_fp32"]["sent_bppis"] == 32.0 and rows["ddp_fp16"]["sent_bppis"] == 16.0
    assert rows["diloco_h30_fp32"]["outer_steps"] == plan.steps // 3
    assert rows["diloco_h30_fp32"]["sent_bppis"] == pytest.approx(32.0 / 3, rel=1e-4)
    assert rows["diloco_h30_fp32"]["recv_bppis"] == rows["diloco_h30_fp32"]["sent_bppis"]
    assert 8.0 / 3 < rows["diloco_h30_int8"]["sent_bppis"] < 9.0 / 3                 # 8.5 bits + headers
    assert rows["lm_topk"]["sent_bppis"] < 3.0 and rows["ddp_fp32"]["vs_ddp_pct"] == 0.0
    # A gather at 2 workers delivers the other rank's message; compact indices beat 12-bit ones.
    for name in ("sparseloco_h30", "semisync_h30"):
        assert rows[name]["recv_bppis"] == pytest.approx(rows[name]["sent_bppis"], rel=0.05)
    assert rows["semisync_h30"]["sent_bppis"] < rows["sparseloco_h30"]["sent_bppis"] < 0.5 / 3
    # DiLoCo's fp32 pseudo-gradient is one all-reduce per outer step, nothing else.
    fp32 = _record(out, "diloco_h30_fp32", plan)
    assert [[op for op, _ in step] for step in fp32["messages"] if step] == [["all_reduce"]] * 4
    # The recorder's bytes agree with DiLoCo's own counters (plus the gather's 8-byte size exchange).
    record = _record(out, "semisync_h30", plan)
    for rank, stats in enumerate(record["stats"]):
        assert record["sent_bytes"][rank] == stats["sent_bytes"] + 8 * stats["outer_steps"]
        assert stats["outer_steps"] == record["outer_steps"] == 4
    assert all(r["t_10mbit"] is None for r in result.rows)
    assert any("no time phase yet" in n for n in result.notes)
    assert result.plots and os.path.getsize(result.plots[0]) > 1000
    with open(os.path.join(out, "semisync.json"), encoding="utf-8") as handle:
        curves = json.load(handle)["extra"]["curves"]
    assert curves["2/semisync_h30"]["step"][-1] == plan.steps
    # Cached: a second run trains nothing and gives the same rows.
    again = semisync.run(out, quick=True, methods=QUICK_METHODS, phase="train", show_progress=False)
    assert again.rows == result.rows


def test_reach_steps_continue_the_time_target_rows(tmp_path):
    """``reach_steps`` trains DDP and the shipped rows on past the budget; their first steps are the
    equal-token runs' exactly, the loss and bits columns stay at equal tokens, and the step to DDP's
    final loss is read from the longer runs."""
    out = str(tmp_path)
    with pytest.raises(ValueError, match="reach_steps"):
        semisync.run(out, quick=True, methods=["semisync_h30"], phase="train", reach_steps=sm.QUICK.steps)
    equal = semisync.run(out, quick=True, methods=["semisync_h30", "diloco_h30_fp32"], phase="train",
                         show_progress=False)
    result = semisync.run(out, quick=True, methods=["semisync_h30", "diloco_h30_fp32"], phase="train",
                          show_progress=False, reach_steps=2 * sm.QUICK.steps)
    longer = sm.budget(True, 2 * sm.QUICK.steps)
    assert [r["final_loss"] for r in result.rows] == [r["final_loss"] for r in equal.rows]
    ddp = _record(out, "ddp_fp32", longer)
    assert ddp["curve"][-1]["step"] == 2 * sm.QUICK.steps
    base = {p["step"]: p["val_loss"] for p in _record(out, "ddp_fp32", sm.QUICK)["curve"]}
    assert all(p["val_loss"] == base[p["step"]] for p in ddp["curve"] if p["step"] in base)
    assert not os.path.exists(semisync.train_path(os.path.join(out, "cache"), "diloco_h30_fp32",
                                                  sm.METHODS["diloco_h30_fp32"], 0, 2, longer))   # not a target row
    rows = {r["method"]: r for r in result.rows}
    assert rows["ddp_fp32"]["step_to_ddp"] == sm.QUICK.steps    # DDP first reaches its own final loss at its end
    note = next(n for n in result.notes if "continued to" in n)
    assert "ddp_fp32, semisync_h30" in note and "at most 0 in validation loss" in note
    with pytest.raises(SystemExit, match="--reach-steps does not apply"):
        from deepreduce.cli import main as cli_main
        cli_main(["reproduce", "quality", "--out", out, "--reach-steps", "20"])


@pytest.mark.slow
def test_semisync_time_phase_quick(tmp_path):
    """Where namespaces exist: profile, link timing at 2 workers and combine; else the note says why."""
    available, why = netns.namespaces_available()
    out = str(tmp_path)
    before = netns.namespaces_of_ours() if available else set()
    result = semisync.run(out, quick=True, methods=["semisync_h30"], steps=6, show_progress=False)
    rows = {r["method"]: r for r in result.rows}
    if not available:
        assert any("time phase SKIPPED" in n and why in n for n in result.notes)
        return
    assert netns.namespaces_of_ours() == before
    timing = json.load(open(semisync.time_path(os.path.join(out, "cache"), 2, sm.budget(True, 6)), encoding="utf-8"))
    assert set(timing["links"]) == {"10mbit", "100mbit"} and all("tbf" in q for q in timing["qdisc"].values())
    slow, fast = (dict(((op, b), s) for op, b, s in timing["links"][net]) for net in ("10mbit", "100mbit"))
    big = max(slow, key=lambda key: key[1])
    # The DDP all-reduce is paced by the link: a 2-rank ring moves the tensor once each way.
    assert big[0] == "all_reduce" and slow[big] >= 0.8 * big[1] * 8 / 10e6 and slow[big] > 3 * fast[big]
    assert rows["ddp_fp32"]["t_10mbit"] > rows["ddp_fp32"]["t_100mbit"] > 0
    assert rows["ddp_fp32"]["x_ddp_10mbit"] == 1.0


@pytest.mark.slow
def test_four_ranks_over_two_namespaces(tmp_path):
    """The 4-worker layout: two namespaces of two ranks, messages timed over the shaped link."""
    available, why = netns.namespaces_available()
    if not available:
        with pytest.raises((RuntimeError, OSError), match="."):   # it cannot be created: see `why`
            with netns.ShapedLink():
                pass
        return
    out = str(tmp_path / "link.json")
    with netns.ShapedLink() as link:
        link.shape(100e6)
        semisync._launch("experiments.reproduce.semisync_link", 4,
                         ["--messages", json.dumps([["all_gather", 1000], ["all_to_all_single", 3000],
                                                    ["all_reduce", 400_000]]),
                          "--repeats", "1", "--out", out], str(tmp_path / "link"), 300, link)
    measured = {op: s for op, _, s in json.load(open(out, encoding="utf-8"))}
    assert set(measured) == {"all_gather", "all_to_all_single", "all_reduce"}
    # 400 kB all-reduced by 4 ranks: at least half of it crosses the 100 Mbit/s link once.
    assert measured["all_reduce"] >= 0.5 * 400_000 * 8 / 100e6


def test_cached_time_phase_is_reused_only_when_it_covers_the_runs(tmp_path):
    plan = sm.QUICK
    runs = {"ddp_fp32": [{"messages": [[["all_reduce", 40]]]}], "lm_topk": [{"messages": [[["all_gather", 9]]]}]}
    assert not semisync._covers(str(tmp_path), 2, plan, runs)                    # nothing cached
    entry = {"profile": {"ddp_fp32": [[0.1, True]]}, "links": {"10mbit": [["all_reduce", 40, 0.5]]}}
    with open(semisync.time_path(str(tmp_path), 2, plan), "w", encoding="utf-8") as handle:
        json.dump(entry, handle)
    assert not semisync._covers(str(tmp_path), 2, plan, runs)                    # lm_topk not profiled
    assert semisync._covers(str(tmp_path), 2, plan, {"ddp_fp32": runs["ddp_fp32"]})
    entry["profile"]["lm_topk"] = [[0.1, True]]
    with open(semisync.time_path(str(tmp_path), 2, plan), "w", encoding="utf-8") as handle:
        json.dump(entry, handle)
    assert not semisync._covers(str(tmp_path), 2, plan, runs)                    # all_gather never timed
