"""The shared harness of the replayed benchmarks (``reproduce semisync``, ``reproduce hsdp``).

Both train every (method, seed, workers) over loopback recording each step's messages, cache each
run as JSON, and later read the loss curves against a wall clock rebuilt from measured compute
and link times (:mod:`~experiments.reproduce.semisync_replay`). What they share lives here:
starting one worker process per rank and collecting the ranks' JSON (:func:`run_ranks`), the
cached train phase (:func:`train_phase`, :func:`train_path`, :func:`load_records`) and the reading
of curves against clocks (:func:`reach`, :func:`mean_curve`). A benchmark names its own worker
module (``python -m <worker> --mode MODE --method JSON --data --budget --seed --out --rank
--world --init [extra]``) and its file prefix.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import asdict
from typing import Dict, List, Optional, Sequence

from . import semisync_replay as rp
from .common import progress_bar
from .netns import launch_ranks, python_module


def free_port() -> int:
    """A TCP port free on loopback now (rank 0's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    port = free_port()
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
                          extra=[r.get("extra", {}) for r in ranks])
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
