"""Time to accuracy: a language model trained on 2 ranks over a shaped link, per compression method.

The task is not saturated: a small transformer (:mod:`experiments.lm.model`) learns the CPython
standard library's source (:mod:`experiments.lm.data`, no download) with a word-level vocabulary
whose embedding gradient is row-sparse. Two ranks in two network namespaces joined by a veth pair
(:mod:`experiments.reproduce.netns`, as in fig11) train it with each method for the same token
budget, with ``tc`` token-bucket shaping at 100 Mbit/s and then 1 Gbit/s, and log the validation
loss against training wall-clock time (:mod:`experiments.reproduce.quality_worker`). Methods:

* ``dense``: DDP's all-reduce; ``fp16``: PyTorch's ``fp16_compress_hook``; ``powersgd4``:
  PyTorch's ``powerSGD_hook`` at rank 4 (error feedback and warm start as shipped, compression from
  iteration 2);
* deepreduce's DDP hook with the shipped configs ``topk_raw`` (Top-r 1%, raw indices),
  ``elias_fano`` (Elias-Fano indices), ``bf_p0`` (Bloom indices, policy P0), ``qsgd`` (QSGD
  values), ``sidco_exp`` (SIDCo) and ``dgc`` (DGC), the papers' settings, and the configs
  recommended for a model of this kind (:data:`RECOMMENDED`: Top-r without error feedback, or
  quantisation of every entry; docs/benchmarks.md says what each lever bought); ``<config>@sparse_allreduce``
  (the sparse all-reduce) and ``lm_topk@auto`` (the planner's choice per DDP bucket).

Per method and bandwidth the table shows the final validation loss (nats per token) and bits per
byte, the loss relative to dense, the training time until the validation loss first reached the
dense run's final loss (``-`` for not reached) and the speed-up that is over dense, the bytes one
rank hands to its collectives per step, and a step split into compute, codec and communication
(medians of a few profiled steps after the budget). The plot has one panel per bandwidth, one
line per method.

Needs root with iproute2 (it creates namespaces); where that is not possible the result is empty
and says why. ``quick`` runs a short budget for a few minutes, ``methods`` picks a subset (dense
is always run: the other rows are measured against it).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Sequence

import numpy as np

from . import torch_hooks
from .common import Result, named_config, no_plot_note, progress_bar, pyplot, save_figure
from .netns import ShapedLink, launch_ranks, master_addr, namespaces_available, python_module

BANDWIDTHS = (("100mbit", 100e6), ("1gbit", 1e9))
# name -> a PyTorch DDP hook spec, or the name of a shipped deepreduce config (``name@aggregation``:
# that config with the given aggregation, e.g. the sparse all-reduce).
METHODS: Dict[str, object] = {
    "dense": torch_hooks.spec("allreduce"),
    "fp16": torch_hooks.spec("fp16"),
    "powersgd4": torch_hooks.spec("powersgd", 4),
    "topk_raw": "topk_raw",
    "elias_fano": "elias_fano",
    "bf_p0": "bf_p0",
    "qsgd": "qsgd",
    "sidco_exp": "sidco_exp",
    "dgc": "dgc",
    "topk_raw@sparse_allreduce": "topk_raw@sparse_allreduce",
    "elias_fano@sparse_allreduce": "elias_fano@sparse_allreduce",
    "lm_topk": "lm_topk",
    "lm_qsgd": "lm_qsgd",
    "lm_topk@auto": "lm_topk@auto",   # the planner's pick per DDP bucket, the link probed at run time
}
# The shipped configs recommended for a transformer LM trained with Adam (the 2% target is theirs).
RECOMMENDED = ("lm_topk", "lm_qsgd")
BASELINE = "dense"
TOLERANCE = 0.02          # the target: final loss within 2% of dense


@dataclass(frozen=True)
class Budget:
    """How long each method trains and how often it is evaluated."""

    steps: int
    eval_every: int
    eval_windows: int      # validation windows of the model's context (over both ranks)
    profile_steps: int
    batch: int = 8         # sequences per rank per step
    lr: float = 2e-3
    warmup: int = 20


FULL = Budget(steps=250, eval_every=25, eval_windows=64, profile_steps=5)
QUICK = Budget(steps=30, eval_every=10, eval_windows=64, profile_steps=3, warmup=10)


def select(names: Optional[Sequence[str]]) -> List[str]:
    """The methods to run, in table order, with the dense baseline always first."""
    if not names:
        return list(METHODS)
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"quality: unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")
    return [n for n in METHODS if n == BASELINE or n in names]


def _specs(names: List[str], result: Result, configs_dir: Optional[str]) -> list:
    specs = []
    for name in names:
        method = METHODS[name]
        if isinstance(method, str):
            stem, _, aggregation = method.partition("@")
            method = named_config(stem, result, configs_dir)
            if method is None:
                continue            # a codec not in this build: noted, go on
            if aggregation:
                method = dict(method, aggregation={"id": aggregation})
        specs.append([name, method])
    return specs


def read_events(path: str) -> Dict[str, dict]:
    """``{method: {"curve": [eval events], "summary": {...}}}`` from a worker's JSON lines."""
    out: Dict[str, dict] = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            event = json.loads(line)
            entry = out.setdefault(event["method"], {"curve": [], "summary": None})
            if "summary" in event:
                entry["summary"] = event["summary"]
            else:
                entry["curve"].append(event)
    return out


def time_to_reach(curve: List[dict], target: float) -> Optional[float]:
    """Training time of the first evaluation at or below ``target`` (None: never)."""
    return next((e["time_s"] for e in curve if e["val_loss"] <= target), None)


class _Progress:
    """Advances a bar by the training steps rank 0 has reported in its events file."""

    def __init__(self, bar, path: str) -> None:
        self.bar, self.path, self.offset, self.done = bar, path, 0, {}

    def __call__(self) -> None:
        if self.bar is None or not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8") as handle:
            handle.seek(self.offset)
            lines = handle.readlines()
        for line in lines:
            if not line.endswith("\n"):
                break                    # a line still being written: read it next time
            self.offset += len(line.encode("utf-8"))
            event = json.loads(line)
            if "step" in event:
                self.bar.update(event["step"] - self.done.get(event["method"], 0))
                self.done[event["method"]] = event["step"]


def run(out_dir: str, quick: bool = False, methods: Optional[Sequence[str]] = None, steps: Optional[int] = None,
        show_progress: bool = True, timeout: Optional[float] = None, configs_dir: Optional[str] = None) -> Result:
    from ..lm import data as lm_data
    from ..lm.model import LMConfig

    os.makedirs(out_dir, exist_ok=True)
    budget = QUICK if quick else FULL
    if steps is not None:
        if steps < 1:
            raise ValueError(f"quality: steps must be at least 1, got {steps}")
        budget = replace(budget, steps=steps, eval_every=min(budget.eval_every, steps))
    model = LMConfig()
    names = select(methods)
    result = Result("quality", f"Time to accuracy - a {model.layers}-layer transformer LM on the Python standard "
                    f"library, 2 ranks over a shaped link, {budget.steps} steps per method",
                    ["network", "method", "final_loss", "bpb", "vs_dense_pct", "within_2pct", "time_to_dense_s",
                     "speedup", "train_s", "bytes_per_step", "volume", "compute_ms", "codec_ms", "comm_ms",
                     "step_ms"])
    available, why = namespaces_available()
    if not available:
        result.notes.append(f"SKIPPED: network namespaces are unavailable ({why}); this experiment measures "
                            "time over a shaped link and needs root with iproute2")
        return result
    specs = _specs(names, result, configs_dir)
    data, data_path = lm_data.load(model.vocab_size)
    timeout = timeout or (900 if quick else 4 * 3600)
    base = python_module("experiments.reproduce.quality_worker", "--world", "2", "--methods", json.dumps(specs),
                         "--data", data_path, "--model", json.dumps(model.to_dict()), "--steps", str(budget.steps),
                         "--batch", str(budget.batch), "--lr", str(budget.lr), "--warmup", str(budget.warmup),
                         "--eval-every", str(budget.eval_every), "--eval-windows", str(budget.eval_windows),
                         "--profile-steps", str(budget.profile_steps), "--timeout", "600")
    runs: Dict[str, Dict[str, dict]] = {}
    bar = progress_bar(len(BANDWIDTHS) * len(specs) * budget.steps, "quality", enabled=show_progress)
    try:
        with ShapedLink() as link:
            for i, (net, rate) in enumerate(BANDWIDTHS):
                link.shape(rate)
                result.extra.setdefault("qdisc", {})[net] = link.qdisc()
                events = os.path.join(out_dir, f"quality_{net}.jsonl")
                if os.path.exists(events):
                    os.remove(events)     # never report an earlier run's figures
                commands = [base + ["--init", f"tcp://{master_addr(link)}:{29450 + i}", "--rank", str(rank)]
                            + (["--events", events] if rank == 0 else []) for rank in (0, 1)]
                launch_ranks(link, commands, os.path.join(out_dir, f"quality_{net}"), timeout, "quality",
                             poll=_Progress(bar, events))
                runs[net] = read_events(events)
    finally:
        if bar is not None:
            bar.close()
    for net, _ in BANDWIDTHS:
        _rows(result, net, runs[net])
    _notes(result, runs, budget, model, data)
    _targets(result)
    result.extra.update(runs=runs, budget=asdict(budget), model=model.to_dict())
    _plot(result, runs, out_dir)
    return result


def _rows(result: Result, net: str, run: Dict[str, dict]) -> None:
    dense = run[BASELINE]
    target = dense["curve"][-1]["val_loss"]
    dense_time = time_to_reach(dense["curve"], target)
    for name, entry in run.items():
        last, summary = entry["curve"][-1], entry["summary"]
        reached = time_to_reach(entry["curve"], target)
        result.rows.append({
            "network": net, "method": name, "final_loss": last["val_loss"], "bpb": last["bpb"],
            "vs_dense_pct": 100 * (last["val_loss"] / target - 1),
            "within_2pct": last["val_loss"] <= target * (1 + TOLERANCE),
            "time_to_dense_s": reached, "speedup": dense_time / reached if reached else None,
            "train_s": last["time_s"], "bytes_per_step": summary["bytes_per_step"],
            "volume": summary["bytes_per_step"] / summary["dense_bytes"],
            "compute_ms": 1e3 * summary["compute_s"], "codec_ms": 1e3 * summary["codec_s"],
            "comm_ms": 1e3 * summary["comm_s"], "step_ms": 1e3 * summary["step_s"],
        })


def _notes(result: Result, runs: Dict[str, Dict[str, dict]], budget: Budget, model, data) -> None:
    slowest = BANDWIDTHS[0][0]
    dense = runs[slowest][BASELINE]
    summary, curve = dense["summary"], dense["curve"]
    rows_touched = [np.unique(data.batch(0, rank, budget.batch, model.context)[0]).size / model.vocab_size
                    for rank in (0, 1)]
    result.notes.append(
        f"model: {summary['parameters'] / 1e6:.2f} M parameters ({model.vocab_size}-token vocabulary, width "
        f"{model.width}, {model.layers} layers, context {model.context}); a rank's batch touches "
        f"{100 * np.mean(rows_touched):.1f}% of the embedding's rows; {budget.steps} steps x {budget.batch} "
        f"sequences x {model.context} tokens x 2 ranks = {budget.steps * budget.batch * model.context * 2:,} "
        f"training tokens per method ({data.train.size:,} in the training split)")
    result.notes.append(
        f"sizing at {slowest}: dense communication {1e3 * summary['comm_s']:.0f} ms of a "
        f"{1e3 * summary['step_s']:.0f} ms step ({100 * summary['comm_s'] / summary['step_s']:.0f}%); dense "
        f"validation loss over its last two evaluations {curve[-2]['val_loss']:.4f} -> {curve[-1]['val_loss']:.4f}"
        f" ({'still falling' if curve[-1]['val_loss'] < curve[-2]['val_loss'] else 'NOT falling'})")
    result.notes.append(
        "final_loss = validation cross entropy (nats/token) after the budget, bpb = bits per byte of source; "
        "time_to_dense_s = training time (evaluation excluded) of the first evaluation at or below the dense "
        f"run's final loss (every {budget.eval_every} steps); speedup = dense's time / that time; bytes_per_step = "
        "what one rank hands to its collectives; the step split: medians of "
        f"{budget.profile_steps} profiled steps after the budget, max over ranks, PyTorch hooks timed with "
        "HookTimer, deepreduce from its DDP state's counters (its encoding runs on a worker thread and may "
        "overlap backward); compute = step - codec - communication")
    result.notes.append(f"every method runs as one DDP bucket holding the whole gradient (no overlap with "
                        f"backward); PowerSGD: PyTorch's PowerSGDState with start_powerSGD_iter="
                        f"{torch_hooks.START_POWERSGD_ITER} (its default of 1000 exceeds the budget)")


def _targets(result: Result) -> None:
    """The issue's targets, met or missed by how much, as notes."""
    deepreduce = [r for r in result.rows if isinstance(METHODS[r["method"]], str)]
    if not deepreduce:
        return
    missed = sorted({f"{r['method']} {r['vs_dense_pct']:+.1f}%" for r in deepreduce if not r["within_2pct"]})
    result.notes.append("target, final loss within 2% of dense: " + (f"missed by {', '.join(missed)}" if missed
                                                                     else "met by every deepreduce config"))
    recommended = sorted({f"{r['method']} {r['vs_dense_pct']:+.1f}%" for r in deepreduce
                          if r["method"] in RECOMMENDED})
    if recommended:
        result.notes.append(f"recommended configs for this model, final loss vs dense: {', '.join(recommended)}")
    for net, _ in BANDWIDTHS:
        rows = {r["method"]: r for r in result.rows if r["network"] == net}
        reached = [r for r in deepreduce if r["network"] == net and r["time_to_dense_s"] is not None]
        if not reached:
            result.notes.append(f"{net}: no deepreduce config reached the dense run's final loss")
            continue
        best = min(reached, key=lambda r: r["time_to_dense_s"])
        others = ", ".join(f"{name} {rows[name]['time_to_dense_s']:.1f} s" if rows[name]["time_to_dense_s"]
                           else f"{name} not reached" for name in ("dense", "fp16", "powersgd4") if name in rows)
        result.notes.append(f"{net}: best deepreduce config {best['method']} reaches the dense final loss in "
                            f"{best['time_to_dense_s']:.1f} s ({best['speedup']:.2f}x dense); {others}")


def _plot(result: Result, runs: Dict[str, Dict[str, dict]], out_dir: str) -> None:
    plt = pyplot()
    if plt is None:
        no_plot_note(result)
        return
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), squeeze=False)
    for ax, (net, run) in zip(axes[0], runs.items()):
        for name, entry in run.items():
            curve = entry["curve"]
            style = "--" if torch_hooks.is_hook(METHODS[name]) else "-"
            ax.plot([e["time_s"] for e in curve], [e["val_loss"] for e in curve], style, marker=".", label=name)
        ax.axhline(run[BASELINE]["curve"][-1]["val_loss"], color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("validation loss (nats/token)")
        ax.set_title(net)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(result, fig, out_dir, "quality_loss_vs_time.png")
