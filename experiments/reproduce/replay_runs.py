"""The shared harness of the replayed benchmarks (``reproduce semisync``, ``reproduce hsdp``).

Both train every (method, seed, workers) over loopback recording each step's messages, cache each
run as JSON, and later read the loss curves against a wall clock rebuilt from measured compute
and link times (:mod:`~experiments.reproduce.semisync_replay`). What they share lives here:
starting one worker process per rank and collecting the ranks' JSON (:func:`run_ranks`), the
cached train phase (:func:`train_phase`, :func:`train_path`, :func:`load_records`), the time
phase's parts (:func:`profiles` over loopback, :func:`time_links` over the shaped link, ranks
placed by :func:`launch`) and the reading of curves against clocks (:func:`clocks`,
:func:`reach`, :func:`mean_curve`). A benchmark names its own worker
module (``python -m <worker> --mode MODE --method JSON --data --budget --seed --out --rank
--world --init [extra]``) and its file prefix.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import asdict
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from ..processes import rendezvous_port
from . import semisync_replay as rp
from .common import progress_bar
from .netns import ShapedLink, launch_ranks, master_addr, python_module


def tag(method: dict) -> str:
    """A short hash of a method's spec (cache names change when the spec does)."""
    return hashlib.sha256(json.dumps(method, sort_keys=True).encode()).hexdigest()[:8]


def train_path(cache: str, name: str, method: dict, seed: int, world: int, plan, prefix: str = "train") -> str:
    return os.path.join(cache, f"{prefix}_{name}_s{seed}_w{world}_{plan.key()}_{tag(method)}.json")


def run_ranks(worker: str, mode: str, name: str, method: dict, seed: int, world: int, plan, data_path: str,
              work: str, timeout: float, extra: Sequence[str] = ()) -> List[dict]:
    """Run ``worker`` on ``world`` ranks over loopback; the ranks' JSON results, by rank."""
    outs = [os.path.join(work, f"{mode}_{name}_s{seed}_w{world}.rank{r}.json") for r in range(world)]
    for path in outs:
        if os.path.exists(path):
            os.remove(path)
    base = ["--mode", mode, "--method", json.dumps([name, method]), "--data", data_path,
            "--budget", json.dumps(asdict(plan)), "--seed", str(seed), *extra]
    port = rendezvous_port()
    commands = [python_module(worker, *base, "--out", outs[r], "--rank", str(r), "--world", str(world),
                              "--init", f"tcp://127.0.0.1:{port}") for r in range(world)]
    what = worker.rsplit(".", 1)[-1]
    launch_ranks(None, commands, os.path.join(work, f"{mode}_{name}_s{seed}_w{world}"), timeout, what)
    ranks = []
    for path in outs:
        with open(path, encoding="utf-8") as handle:
            ranks.append(json.load(handle))
    return ranks


def train_phase(worker: str, methods: Dict[str, dict], seeds: Sequence[int], workers: Sequence[int], plan,
                data_path: str, cache: str, timeout: float, show_progress: bool, prefix: str = "train",
                extra: Sequence[str] = ()) -> None:
    """Train every (method, seed, workers) not in the cache; write each run's merged record."""
    todo = [(n, s, w) for w in workers for s in seeds for n in methods
            if not os.path.exists(train_path(cache, n, methods[n], s, w, plan, prefix))]
    bar = progress_bar(len(todo), f"{worker.rsplit('.', 1)[-1]} train", enabled=show_progress)
    try:
        for name, seed, world in todo:
            ranks = run_ranks(worker, "train", name, methods[name], seed, world, plan, data_path, cache, timeout,
                              extra)
            record = rp.merge_ranks(ranks)
            record.update(seed=seed, method_spec=methods[name], budget=asdict(plan),
                          extra=[r.get("extra", {}) for r in ranks], inside=[r.get("inside", [0, 0]) for r in ranks])
            path = train_path(cache, name, methods[name], seed, world, plan, prefix)
            with open(f"{path}.tmp", "w", encoding="utf-8") as handle:
                json.dump(record, handle)
            os.replace(f"{path}.tmp", path)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def load_records(methods: Dict[str, dict], seeds: Sequence[int], workers: Sequence[int], plan, cache: str,
                 prefix: str = "train") -> Dict[int, Dict[str, List[dict]]]:
    """``{workers: {method: [record per seed]}}`` of the cached runs (missing ones left out)."""
    out: Dict[int, Dict[str, List[dict]]] = {}
    for world in workers:
        for name, method in methods.items():
            for seed in seeds:
                path = train_path(cache, name, method, seed, world, plan, prefix)
                if os.path.exists(path):
                    with open(path, encoding="utf-8") as handle:
                        out.setdefault(world, {}).setdefault(name, []).append(json.load(handle))
    return out


def reach(seeds: List[dict], clocks: Optional[List[List[float]]], target: float) -> Optional[float]:
    """Mean over seeds of the wall time to ``target``; None if a seed never reaches it or no timing."""
    if not clocks:
        return None
    times = [rp.time_to_reach(r["curve"], clock, target) for r, clock in zip(seeds, clocks)]
    return None if any(t is None for t in times) else sum(times) / len(times)


def timed(runs: Dict[str, List[dict]], extended: Optional[Dict[str, List[dict]]]) -> Dict[str, List[dict]]:
    """Each row's runs to read times from: its ``extended`` (continued) runs where it has them for
    every seed of its equal-token ``runs``, else those."""
    extended = extended or {}
    return {name: extended[name] if len(extended.get(name, ())) == len(seeds) else seeds
            for name, seeds in runs.items()}


def step_to(seeds: List[dict], target: float) -> Optional[float]:
    """Mean over seeds of the first evaluated step at or below ``target`` (None: a seed never gets there)."""
    steps = [next((p["step"] for p in r["curve"] if p["step"] > 0 and p["val_loss"] <= target), None) for r in seeds]
    return None if any(s is None for s in steps) else sum(steps) / len(steps)


def reach_note(result, records: Dict[int, Dict[str, List[dict]]], extended: Dict[int, Dict[str, List[dict]]],
               steps: int, longer: int, unit: str, step_column: str, prefix: Callable[[int], str]) -> None:
    """A note per world size: which rows were continued to ``longer`` steps for their times, and
    whether their first ``steps`` steps are the equal-token runs' (the largest difference of
    validation loss at the steps both evaluated)."""
    for world, runs in sorted(extended.items()):
        gaps = []
        for name, seeds in runs.items():
            for base, run in zip(records.get(world, {}).get(name, []), seeds):
                old = {p["step"]: p["val_loss"] for p in base["curve"]}
                gaps += [abs(p["val_loss"] - old[p["step"]]) for p in run["curve"] if p["step"] in old]
        result.notes.append(
            f"{prefix(world)}t_<net>, x_* and {step_column} of {', '.join(sorted(runs))} from runs continued to "
            f"{longer} {unit} (the final_loss, bytes and state columns stay at {steps}); over their first "
            f"{steps} {unit} these runs differ from the equal-token runs by at most {max(gaps, default=0.0):.2g} "
            "in validation loss")


def mean_curve(seeds: List[dict], clocks: Dict[str, List[List[float]]]) -> dict:
    """Mean validation loss at each evaluation step, and the mean wall time there per bandwidth."""
    steps = [p["step"] for p in seeds[0]["curve"]]
    common = [s for s in steps if all(any(p["step"] == s for p in r["curve"]) for r in seeds)]
    loss = [sum(next(p["val_loss"] for p in r["curve"] if p["step"] == s) for r in seeds) / len(seeds)
            for s in common]
    out = {"step": common, "val_loss": loss}
    for net, per_seed in clocks.items():
        out[f"time_{net}"] = [0.0 if s == 0 else sum(c[s - 1] for c in per_seed) / len(per_seed) for s in common]
    return out


LINK_WORKER = "experiments.reproduce.semisync_link"
_LINK_PORTS = itertools.count(29650)    # inside fresh namespaces any port is free; a new one per launch


def launch(worker: str, world: int, args: List[str], log: str, timeout: float, link=None,
           what: str = "replay") -> None:
    """Run ``worker`` on ``world`` ranks: over loopback, or over ``link`` as two hosts of
    ``world / 2`` ranks (one namespace each)."""
    port = rendezvous_port() if link is None else next(_LINK_PORTS)
    commands = [python_module(worker, *args, "--rank", str(r), "--world", str(world),
                              "--init", f"tcp://{master_addr(link)}:{port}") for r in range(world)]
    launch_ranks(link, commands, log, timeout, what, per_namespace=max(1, world // 2))


def profiles(worker: str, methods: Dict[str, dict], names: Sequence[str], world: int, plan, data_path: str,
             work: str, timeout: float, extra: Sequence[str] = ()) -> Dict[str, List[list]]:
    """``{method: [[slowest rank's seconds, whether any rank sent], ...]}`` of a loopback profile."""
    out = {}
    for name in names:
        ranks = run_ranks(worker, "profile", name, methods[name], 0, world, plan, data_path, work, timeout, extra)
        steps = zip(*(r["steps"] for r in ranks))
        out[name] = [[max(s for s, _ in step), any(synced for _, synced in step)] for step in steps]
    return out


def messages_to_time(records: Iterable[dict], per_op: int) -> List[list]:
    """``[[op, bytes], ...]``: the representative sizes (:func:`semisync_replay.representatives`)
    of every kind of collective the records hold."""
    sizes = rp.distinct_messages(records)
    return [[op, size] for op, found in sizes.items() for size in rp.representatives(found, per_op)]


def time_links(messages: List[list], world: int, bandwidths: Sequence[Tuple[str, float]], work: str,
               timeout: float, repeats: int, groups: Optional[List[List[int]]] = None, what: str = "replay"
               ) -> Tuple[Dict[str, list], Dict[str, str]]:
    """Each message's measured seconds over a fresh :class:`~experiments.reproduce.netns.ShapedLink`
    at each bandwidth (``({net: [[op, bytes, seconds], ...]}, {net: qdisc})``); ``groups``: the
    ranks replay inside these groups (see :mod:`~experiments.reproduce.semisync_link`)."""
    links, qdiscs = {}, {}
    with ShapedLink() as link:
        for net, rate in bandwidths:
            link.shape(rate)
            qdiscs[net] = link.qdisc()
            out = os.path.join(work, f"{what}_link_w{world}_{net}.json")
            args = ["--messages", json.dumps(messages), "--repeats", str(repeats), "--out", out]
            if groups is not None:
                args += ["--groups", json.dumps(groups)]
            launch(LINK_WORKER, world, args, os.path.join(work, f"{what}_link_w{world}_{net}"), timeout, link, what)
            with open(out, encoding="utf-8") as handle:
                links[net] = json.load(handle)
    return links, qdiscs


def clocks(runs: Dict[str, List[dict]], timing: Optional[dict], bandwidths: Sequence[Tuple[str, float]],
           delay_of: Callable[[str], int] = lambda name: 0) -> Dict[str, dict]:
    """``{method: {net: [wall clock per step, per seed]}}`` from a time phase's entry (``profile``,
    ``links``); empty without one. ``delay_of(method)``: steps its messages overlap."""
    if timing is None:
        return {}
    transfers = {net: rp.Transfer(timing["links"][net]) for net, _ in bandwidths}
    out: Dict[str, dict] = {}
    for name, seeds in runs.items():
        if name not in timing["profile"]:
            continue
        compute = rp.compute_times(timing["profile"][name])
        out[name] = {net: [rp.wall_clock(r["messages"], compute, transfers[net], delay_of(name)) for r in seeds]
                     for net, _ in bandwidths}
    return out


def draw_curves(ax, curves: Dict[str, dict], xkey: str, dashed: Callable[[str], bool], step_label: str,
                title: str) -> None:
    """One panel: each curve's validation loss against ``xkey`` (``time_<net>``: replayed wall
    time, log scale; ``step``: the training step); ``dashed(label)`` marks the baselines."""
    from matplotlib.ticker import NullFormatter

    timed = xkey != "step"
    for label, curve in curves.items():
        if xkey in curve:   # a log time axis has no 0: a timed curve starts at its first evaluation after it
            points = [(x, y) for x, y in zip(curve[xkey], curve["val_loss"]) if x > 0 or not timed]
            ax.plot([x for x, _ in points], [y for _, y in points], "--" if dashed(label) else "-", marker=".",
                    markersize=3, label=label)
    if timed:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("replayed wall time (s)" if timed else step_label)
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
