"""``deepreduce bench-sparsify``: threshold estimation against Top-r selection (SIDCo Fig. 1).

For one synthetic gradient of ``--size`` entries (default 25,557,032, ResNet-50's size) and
each ratio, in the same process on the same array: the time of Top-r selection with
``np.argpartition`` on the magnitudes (the usual CPU Top-r), and the time of each SIDCo variant
(``select``: magnitudes, staged threshold estimation and the final selection) and DGC; the
median over ``--repeat`` runs, the speed-up over Top-r, and the selected count over the target
``k_hat / k`` (mean over the timed runs). Before timing, each sparsifier runs ``--warmup``
steps so SIDCo's stage adaptation settles (its state is kept per tensor, as in training).
The SIDCo rows are the shipped configs ``configs/sidco_{exp,gamma,gpareto}.yaml`` (their
sparsifier section, ratio replaced) when run from the project root, else the defaults.

Run it on one thread for the figures in docs/benchmarks.md::

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 python -m deepreduce bench-sparsify
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np

DEFAULT_SIZE = 25_557_032
DISTS = ("laplace", "gamma", "gpareto", "student-t")


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench-sparsify", help="SIDCo/DGC threshold estimation vs Top-r selection time")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help="gradient length d")
    parser.add_argument("--ratios", default="0.1,0.01,0.001", help="comma-separated target ratios")
    parser.add_argument("--dist", default="laplace", choices=DISTS, help="distribution of the synthetic gradient")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per method (median reported)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before timing (stage adaptation)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-dgc", action="store_true", help="skip DGC")
    parser.add_argument("--real-layers", action="store_true",
                        help="instead: k_hat/k of the shipped SIDCo configs on every saved ResNet-20 layer")
    parser.add_argument("--steps", type=int, default=12, help="--real-layers: encodes per layer")
    parser.set_defaults(func=run)


def synthetic(size: int, dist: str, seed: int) -> np.ndarray:
    """A symmetric gradient with magnitudes from ``dist`` (scale 1e-3)."""
    rng = np.random.default_rng(seed)
    if dist == "laplace":
        g = rng.laplace(scale=1e-3, size=size)
    elif dist == "student-t":
        g = rng.standard_t(3, size=size) * 1e-3
    else:
        mag = rng.gamma(0.6, 1e-3, size=size) if dist == "gamma" else rng.pareto(5.0, size=size) * 1e-3
        g = mag * np.where(rng.random(size) < 0.5, -1.0, 1.0)
    return g.astype(np.float32)


SHIPPED_SIDCO = {"exponential": "sidco_exp", "gamma": "sidco_gamma", "gpareto": "sidco_gpareto"}


def shipped_sidco(distribution: str) -> dict:
    """The sparsifier section of the shipped SIDCo config for ``distribution`` (or the defaults)."""
    from deepreduce.config import load_config

    path = os.path.join("configs", SHIPPED_SIDCO[distribution] + ".yaml")
    if os.path.isfile(path):
        return dict(load_config(path)["sparsifier"])
    return {"id": "sidco", "distribution": distribution}


def time_topr(grad: np.ndarray, k: int, repeat: int) -> float:
    d = grad.size
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        chosen = np.argpartition(np.abs(grad), d - k)[d - k:]
        times.append(time.perf_counter() - t0)
        assert chosen.size == k
    return statistics.median(times)


def time_sparsifier(sp, grad: np.ndarray, k: int, repeat: int, warmup: int):
    from deepreduce.wire.seeding import EncodeContext, config_digest

    digest = config_digest(sp.get_config())
    for step in range(warmup):
        sp.select(grad, EncodeContext(digest, "bench", step))
    times, counts = [], []
    for step in range(warmup, warmup + repeat):
        ctx = EncodeContext(digest, "bench", step)
        t0 = time.perf_counter()
        chosen = sp.select(grad, ctx)
        times.append(time.perf_counter() - t0)
        counts.append(chosen.size / k)
    stages = getattr(sp, "last", {}).get("stages", "")
    return statistics.median(times), float(np.mean(counts)), stages


def real_layer_rows(steps: int):
    """Per shipped SIDCo config and saved ResNet-20 layer: first-step ``k_hat/k`` of one stage
    (the paper's start), of the shipped stages without and with the tail check, and the range
    of ``k_hat/k`` over ``steps`` encodes through the config as shipped (residual memory)."""
    from deepreduce.config import build, load_config

    from .. import gradients

    layers = {n: g for n, g in gradients.load().items() if n != "all"}
    rows = []
    for dist in ("exponential", "gamma", "gpareto"):
        config = load_config(os.path.join("configs", SHIPPED_SIDCO[dist] + ".yaml"))
        variants = {"1 stage": dict(config["sparsifier"], stages=1, adapt="off"),
                    "fit only": dict(config["sparsifier"], adapt="off", tail_check=False),
                    "shipped": dict(config["sparsifier"], adapt="off")}
        pipe = build(config)
        for name, grad in layers.items():
            if grad.size < pipe.min_numel:
                continue
            first = {}
            for label, sparsifier in variants.items():
                probe = build(dict(config, sparsifier=sparsifier, memory={"id": "none"}))
                probe.sparsifier.select(grad.ravel(), probe.context(name, 0))
                first[label] = probe.sparsifier.last["k_hat"] / probe.sparsifier.last["k"]
            seen, fired = [], 0
            for step in range(steps):
                pipe.encode(grad, name=name, step=step)
                seen.append(pipe.sparsifier.last["k_hat"] / pipe.sparsifier.last["k"])
                fired += pipe.sparsifier.last["exact_tail"]
            rows.append((SHIPPED_SIDCO[dist], name, grad.size, pipe.sparsifier.last["k"], first,
                         min(seen), max(seen), fired))
    return rows


def run_real_layers(args) -> int:
    print(f"k_hat/k on every saved ResNet-20 layer; first step of a fresh sparsifier, and over {args.steps} "
          "encodes through the shipped config (residual memory, the same gradient each step)")
    print(f"{'config':<14} {'layer':<24} {'d':>6} {'k':>4} {'1 stage':>8} {'fit only':>8} {'shipped':>8} "
          f"{'steps min':>9} {'max':>5} {'checked':>7}")
    for cfg, name, d, k, first, low, high, fired in real_layer_rows(args.steps):
        print(f"{cfg:<14} {name:<24} {d:>6} {k:>4} {first['1 stage']:>8.2f} {first['fit only']:>8.2f} "
              f"{first['shipped']:>8.2f} {low:>9.2f} {high:>5.2f} {fired:>4}/{args.steps}")
    return 0


def run(args) -> int:
    from deepreduce import registry
    from deepreduce.sparsify import count_for

    if args.real_layers:
        return run_real_layers(args)

    threads = {v: os.environ.get(v, "unset") for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    print(f"d = {args.size:,}, gradient {args.dist}, median of {args.repeat} runs after {args.warmup} warm-up steps; "
          + ", ".join(f"{k}={v}" for k, v in threads.items()), flush=True)
    grad = synthetic(args.size, args.dist, args.seed)
    header = f"{'ratio':>7} {'method':<16} {'ms':>9} {'speed-up':>9} {'k_hat/k':>8} {'stages':>6}"
    print(header)
    print("-" * len(header))
    for ratio in [float(r) for r in args.ratios.split(",")]:
        k = count_for(ratio, grad.size)
        base = time_topr(grad, k, args.repeat)
        print(f"{ratio:>7g} {'topr-argpartition':<16} {1e3 * base:>9.1f} {1.0:>9.2f} {1.0:>8.3f} {'':>6}", flush=True)
        methods = [(f"sidco-{d[:3]}", dict(shipped_sidco(d), ratio=ratio))
                   for d in ("exponential", "gamma", "gpareto")]
        if not args.no_dgc:
            methods.append(("dgc", {"id": "dgc", "ratio": ratio}))
        for label, config in methods:
            sp = registry.create("sparsifier", config)
            seconds, k_ratio, stages = time_sparsifier(sp, grad, k, args.repeat, args.warmup)
            print(f"{ratio:>7g} {label:<16} {1e3 * seconds:>9.1f} {base / seconds:>9.2f} {k_ratio:>8.3f} "
                  f"{stages!s:>6}", flush=True)
    return 0
