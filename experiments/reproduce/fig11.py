"""DeepReduce Fig. 11: time per training iteration of the recommender over a constrained network.

Two ranks run in two fresh network namespaces joined by one veth pair with private addresses
(``10.213.0.1/30`` and ``10.213.0.2/30``) that exist only inside those namespaces, so no
traffic can reach any other interface or host. ``tc`` shapes both ends of the pair with a
token bucket (``tbf``) to each bandwidth in turn (100 Mbit/s, 1 Gbit/s and 10 Gbit/s; the
last is above what a veth pair moves on a small machine, so there the CPU is the limit). For every
bandwidth one pair of worker processes (:mod:`experiments.reproduce.fig11_worker`, gloo over
TCP) times NCF training iterations split into compute (forward + backward), encode/decode and
communication, for:

* no compression: dense ``all_reduce`` (the paper's NCCL Allreduce baseline);
* Top-r (r = 10%, raw indices and values, error feedback), allgather of containers;
* ``DR^QSGD_BF-P0`` and ``DR^Fit-Poly_BF-P2`` (no sparsifier), allgather of containers;
* what a PyTorch user would pick instead, run as PyTorch ships it: PowerSGD rank 1 and rank 4
  and fp16 compression as DDP communication hooks (:mod:`experiments.reproduce.torch_hooks`).

Every row shows compute, codec (encode + decode) and communication time side by side, their
total and the speed-up over the dense all-reduce.

The experiment needs root (it creates namespaces). Every step has a timeout, and the
namespaces (with the veth pair inside them) are deleted in a ``finally`` block, also on error
or interrupt. Where namespaces cannot be created, it says so in the result and measures the
same workers over unshaped loopback instead, so the table still shows compute and codec costs.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from . import torch_hooks
from .common import Result, named_config, no_plot_note, progress, pyplot, save_figure
from .netns import ShapedLink, launch_ranks, master_addr, namespaces_available, python_module

BANDWIDTHS = (("100mbit", 100e6), ("1gbit", 1e9), ("10gbit", 10e9))
TOPR10 = {"sparsifier": {"id": "topk", "ratio": 0.1}, "index": {"id": "raw"}, "value": {"id": "raw"},
          "memory": {"id": "residual"}}
# label -> config dict, the name of a configs/<name>.yaml, a PyTorch DDP hook, or None for the
# dense all_reduce.
METHODS = [
    ("no compression (allreduce)", None),
    ("Top-r 10%", TOPR10),
    ("DR^QSGD_BF-P0", "bfp0_qsgd"),
    ("DR^Fit-Poly_BF-P2", "bfp2_polyfit"),
    ("PowerSGD rank 1 (torch DDP hook)", torch_hooks.spec("powersgd", 1)),
    ("PowerSGD rank 4 (torch DDP hook)", torch_hooks.spec("powersgd", 4)),
    ("fp16 (torch DDP hook)", torch_hooks.spec("fp16")),
]

def run_workers(link: Optional[ShapedLink], port: int, methods, iterations: int, warmup: int, quick: bool,
                out_json: str, log_prefix: str, timeout: float, accumulate: int = 1) -> dict:
    """Start rank 0 and rank 1 (inside the namespaces when ``link`` is given), wait, return rank 0's JSON."""
    base = python_module("experiments.reproduce.fig11_worker", "--init", f"tcp://{master_addr(link)}:{port}",
                         "--world", "2", "--methods", json.dumps(methods), "--iterations", str(iterations),
                         "--warmup", str(warmup), "--timeout", str(max(60.0, timeout / 2)),
                         "--accumulate", str(accumulate))
    if quick:
        base += ["--quick", "--batch", "512"]
    if os.path.exists(out_json):
        os.remove(out_json)           # never report an earlier run's figures
    commands = [base + ["--rank", str(rank)] + (["--out", out_json] if rank == 0 else []) for rank in (0, 1)]
    launch_ranks(link, commands, log_prefix, timeout, "fig11")
    with open(out_json, encoding="utf-8") as handle:
        return json.load(handle)


def run(out_dir: str, quick: bool = False, iterations: int = None, show_progress: bool = True,
        use_netns: Optional[bool] = None, timeout: float = None, configs_dir: str = None,
        accumulate: int = 1) -> Result:
    from deepreduce.config import load_config

    os.makedirs(out_dir, exist_ok=True)
    iterations = iterations or (2 if quick else 40)
    warmup = 1 if quick else 3
    timeout = timeout or (240 if quick else 1200)
    if accumulate < 1:
        raise ValueError(f"fig11: accumulate must be at least 1, got {accumulate}")
    result = Result("fig11", "Fig. 11 - time per iteration of the NCF-style recommender on 2 ranks over a shaped link"
                    + (f" ({accumulate} accumulated micro-batches per iteration)" if accumulate > 1 else ""),
                    ["network", "method", "compute_ms", "codec_ms", "comm_ms", "total_ms", "speedup",
                     "volume", "ideal_wire_ms"])
    methods = []
    for label, config in METHODS:
        if isinstance(config, str):
            config = named_config(config, result, configs_dir)
            if config is None:
                continue          # a codec not in this build: noted, go on
        elif config is not None and not torch_hooks.is_hook(config):
            config = load_config(config)
        methods.append([label, config])
    available, why = namespaces_available()
    if use_netns is None:
        use_netns = available
    if use_netns and not available:
        raise RuntimeError(f"fig11: network namespaces are not available: {why}")
    if not use_netns:
        result.notes.append(f"NOT SHAPED: network namespaces unavailable ({why}); both ranks ran over loopback "
                            "without a bandwidth limit")
    networks = BANDWIDTHS if use_netns else (("loopback (unshaped)", None),)
    raw = {}
    link = ShapedLink() if use_netns else None
    try:
        if link is not None:
            link.__enter__()
        for i, (net, rate) in enumerate(progress(list(networks), "fig11", enabled=show_progress)):
            if link is not None:
                link.shape(rate)
                result.extra.setdefault("qdisc", {})[net] = link.qdisc()
            out_json = os.path.join(out_dir, f"fig11_{net.split()[0]}.json")
            data = run_workers(link, 29400 + i, methods, iterations, warmup, quick, out_json,
                               os.path.join(out_dir, f"fig11_{net.split()[0]}"), timeout, accumulate)
            raw[net] = data
            base_total = None
            for r in data["results"]:
                total = r["compute_s"] + r["codec_s"] + r["comm_s"]
                if r["method"].startswith("no compression"):
                    base_total = total
                result.rows.append({
                    "network": net, "method": r["method"], "compute_ms": 1e3 * r["compute_s"],
                    "codec_ms": 1e3 * r["codec_s"], "comm_ms": 1e3 * r["comm_s"], "total_ms": 1e3 * total,
                    "speedup": (base_total / total) if base_total else None, "volume": r["volume"],
                    "ideal_wire_ms": (1e3 * 8 * r["bytes_per_rank"] / rate) if rate else None,
                })
    finally:
        if link is not None:
            link.close()
    result.extra.update(raw=raw, iterations=iterations, warmup=warmup, namespaces=use_netns, accumulate=accumulate)
    result.notes.append(f"medians over {iterations} iterations after {warmup} warm-up, max over the 2 ranks; "
                        "ideal_wire_ms = bytes one rank sends / link rate; speedup = no-compression total / total")
    result.notes.append(f"torch DDP hook rows: PyTorch's hooks and state (PowerSGD: error feedback, warm start, "
                        f"start_powerSGD_iter={torch_hooks.START_POWERSGD_ITER}, "
                        f"{torch_hooks.warmup_iterations(torch_hooks.spec('powersgd', 1))} more warm-up iterations); "
                        "codec_ms = hook time outside its all-reduces, comm_ms = those all-reduces, "
                        "compute_ms = the rest of forward + backward")
    _plot(result, out_dir)
    return result


def _plot(result: Result, out_dir: str) -> None:
    plt = pyplot()
    if plt is None:
        no_plot_note(result)
        return
    networks = list(dict.fromkeys(r["network"] for r in result.rows))
    fig, axes = plt.subplots(1, max(1, len(networks)), figsize=(5.5 * max(1, len(networks)), 4.5), squeeze=False)
    for ax, net in zip(axes[0], networks):
        rows = [r for r in result.rows if r["network"] == net]
        x = list(range(len(rows)))
        comp = [r["compute_ms"] for r in rows]
        codec = [r["codec_ms"] for r in rows]
        comm = [r["comm_ms"] for r in rows]
        ax.bar(x, comp, label="forward/backward")
        ax.bar(x, codec, bottom=comp, label="encode/decode")
        ax.bar(x, comm, bottom=[a + b for a, b in zip(comp, codec)], label="communication")
        ax.set_xticks(x)
        ax.set_xticklabels([r["method"] for r in rows], rotation=25, ha="right", fontsize=8)
        ax.set_ylabel("ms per iteration")
        ax.set_title(net)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(result, fig, out_dir, "fig11_time_breakdown.png")
