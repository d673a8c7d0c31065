"""Semi-synchronous training against every-step compression: loss against wall time over a slow link.

The stdlib language model (:mod:`experiments.lm`, a small configuration: see
:class:`~experiments.reproduce.semisync_methods.Budget`) is trained by every method of
:mod:`~experiments.reproduce.semisync_methods` for the same inner steps, batches and seed on 2 and
4 workers: DDP every step (fp32, and fp16 for bf16: PyTorch's bf16 hook needs CUDA), deepreduce's
best every-step config ``lm_topk``, DiLoCo at H in {10, 30, 100} with fp32 and int8
pseudo-gradients, DeMo-style and SparseLoCo-style recipes and deepreduce's semi-synchronous config
with the allgather and the sparse all-reduce.

Training every method over a 10 Mbit/s link is not affordable (DDP's fp32 all-reduce of the
default LM takes seconds per step there), so the benchmark **replays** instead of training on the
link. Three phases:

1. **train** (``--phase train``; the machine may be busy): each (method, seed, workers) trains over
   loopback (gloo), recording the validation loss at each evaluation and the exact messages of
   every step (:mod:`~experiments.reproduce.comm_record`: kind of collective, bytes each rank hands
   in and receives). No clock. Each run is cached as JSON (``<cache>/train_*.json``) and reused.
2. **time** (``--phase time``; on an idle machine, root with iproute2): per workers, a short
   profile of each method over loopback gives the compute time of a step with and without an
   outer step (forward, backward, optimizer, codec); then every distinct message the training
   runs recorded (all sizes when few, else quantiles with both ends, per kind of collective) is
   replayed over the veth pair of :class:`~experiments.reproduce.netns.ShapedLink` shaped with
   tc tbf at 10 Mbit/s and 100 Mbit/s: its real collective with its byte count, 2 workers as one
   rank per namespace, 4 workers as two namespaces of two ranks. Cached as
   ``<cache>/time_w<N>_*.json``.
3. **combine** (always): the wall time after step ``t`` is the sum of the measured compute of the
   steps so far and the measured transfer of their messages (interpolated between measured
   sizes), with the transfer of a streaming row (delay d) overlapping the next d steps
   (:func:`~experiments.reproduce.semisync_replay.wall_clock`); the loss curves then read against
   it.

The table has one row per (workers, method): final validation loss (mean and half-range over the
seeds) and its difference to DDP fp32, time to DDP's final loss at 10 and 100 Mbit/s with the
speed-up against DDP and against ``lm_topk`` (``reach_steps``: from runs of DDP fp32 and fp16,
``lm_topk`` and the shipped semi-synchronous rows continued past the equal-token budget, so a row that ends just
above DDP's loss still gets a time to it), bits per parameter per inner step sent and received
per rank, outer steps. The notes compare the received bytes at 2 and 4 workers of the gathering
and the sparse all-reduce rows and check the issue's targets. The plot shows loss against wall
time, one panel per bandwidth and worker count.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Dict, List, Optional, Sequence

from deepreduce.config import load_config

from . import replay_runs
from . import semisync_methods as sm
from . import semisync_replay as rp
from .common import Result, named_config, no_plot_note, pyplot, save_figure
from .netns import namespaces_available
from .replay_runs import load_records, train_path  # noqa: F401  (train_path: the cached runs by name)

BANDWIDTHS = (("10mbit", 10e6), ("100mbit", 100e6))
PHASES = ("train", "time", "all")
SIZES_PER_OP = 6        # measured sizes per kind of collective (interpolated between)
REPEATS = 3             # timed repeats per measured message (median)
TOLERANCE = 0.02        # the target: within 2% of DDP's final loss
BITS_TARGET = 0.05      # ... sending at most 0.05 bits per parameter per inner step
COLUMNS = ["workers", "method", "final_loss", "spread", "vs_ddp_pct", "sent_bppis", "recv_bppis", "outer_steps",
           "step_to_ddp", "t_10mbit", "x_ddp_10mbit", "x_topk_10mbit", "t_100mbit", "x_ddp_100mbit", "x_topk_100mbit"]


def resolve(names: Sequence[str], result: Result, configs_dir: Optional[str]) -> Dict[str, dict]:
    """Each method with its named configs read (``configs/<name>.yaml``); a missing one is noted and skipped."""
    out = {}
    for name in names:
        method = dict(sm.spec(name))
        key = "config" if method["kind"] == "ddp" else "compression"
        if name in sm.SWEEP and isinstance(method.get(key), dict):
            method[key] = load_config(method[key])     # as a shipped config of the same parameters reads
        if isinstance(method.get(key), str):
            config = named_config(method[key], result, configs_dir)
            if config is None:
                continue
            method[key] = config
        out[name] = method
    return out


WORKER = "experiments.reproduce.semisync_worker"


def _launch(worker: str, world: int, args: List[str], log: str, timeout: float, link=None) -> None:
    replay_runs.launch(worker, world, args, log, timeout, link, "semisync")


def _run_ranks(mode: str, name: str, method: dict, seed: int, world: int, plan: sm.Budget, data_path: str,
               work: str, timeout: float) -> List[dict]:
    return replay_runs.run_ranks(WORKER, mode, name, method, seed, world, plan, data_path, work, timeout)


def train_phase(methods: Dict[str, dict], seeds: Sequence[int], workers: Sequence[int], plan: sm.Budget,
                data_path: str, cache: str, timeout: float, show_progress: bool) -> None:
    """Train every (method, seed, workers) not in the cache (:func:`replay_runs.train_phase`)."""
    replay_runs.train_phase(WORKER, methods, seeds, workers, plan, data_path, cache, timeout, show_progress)


def reaching(methods: Dict[str, dict]) -> Dict[str, dict]:
    """The rows ``reach_steps`` continues: DDP (fp32 and fp16), ``lm_topk`` and the shipped
    semi-synchronous configs (the rows of the time target)."""
    wanted = (sm.BASELINE, "ddp_fp16", sm.PER_STEP_BEST, *sm.SHIPPED_SEMISYNC)
    return {name: method for name, method in methods.items() if name in wanted}


def time_path(cache: str, world: int, plan: sm.Budget) -> str:
    return os.path.join(cache, f"time_w{world}_{plan.key()}.json")


def time_phase(methods: Dict[str, dict], records: Dict[int, Dict[str, List[dict]]], workers: Sequence[int],
               plan: sm.Budget, data_path: str, cache: str, timeout: float) -> None:
    """Profile each method's compute over loopback, then time the recorded messages over the shaped link."""
    for world in workers:
        runs = records.get(world, {})
        profiles = replay_runs.profiles(WORKER, methods, list(runs), world, plan, data_path, cache, timeout)
        messages = replay_runs.messages_to_time((r for seeds in runs.values() for r in seeds), SIZES_PER_OP)
        links, qdiscs = replay_runs.time_links(messages, world, BANDWIDTHS, cache, timeout, REPEATS,
                                               what="semisync")
        entry = {"world": world, "profile": profiles, "links": links, "qdisc": qdiscs, "cpus": os.cpu_count()}
        with open(time_path(cache, world, plan), "w", encoding="utf-8") as handle:
            json.dump(entry, handle)


def _covers(cache: str, world: int, plan: sm.Budget, runs: Dict[str, List[dict]]) -> bool:
    """Whether the cached time phase of ``world`` has every trained method's profile and every
    kind of collective the runs recorded (else ``--phase all`` measures again)."""
    path = time_path(cache, world, plan)
    if not os.path.exists(path):
        return False
    with open(path, encoding="utf-8") as handle:
        entry = json.load(handle)
    ops = set(rp.distinct_messages(r for seeds in runs.values() for r in seeds))
    measured = {op for op, _, _ in next(iter(entry["links"].values()), [])}
    return set(runs) <= set(entry["profile"]) and ops <= measured


def run(out_dir: str, quick: bool = False, methods: Optional[Sequence[str]] = None, steps: Optional[int] = None,
        seeds: Optional[Sequence[int]] = None, workers: Optional[Sequence[int]] = None, phase: str = "all",
        cache: Optional[str] = None, show_progress: bool = True, timeout: Optional[float] = None,
        configs_dir: Optional[str] = None, reach_steps: Optional[int] = None) -> Result:
    """``reach_steps``: also train :func:`reaching`'s rows to that many inner steps (more than the
    budget's) and read the time to DDP's final loss from those runs. The learning rate is constant
    after the warm-up and the batches are drawn step by step, so their first ``steps`` steps are the
    equal-token runs' (the notes check it); the loss and bytes columns stay at equal tokens."""
    from ..lm import data as lm_data

    if phase not in PHASES:
        raise ValueError(f"semisync: unknown phase {phase!r}; known: {', '.join(PHASES)}")
    workers = list(workers or ((2,) if quick else (2, 4)))
    bad = [w for w in workers if w < 2 or w % 2]
    if bad:
        raise ValueError(f"semisync: workers must be even and at least 2 (two hosts of N/2 ranks), got {bad}")
    seeds = list(seeds if seeds is not None else ((0,) if quick else (0, 1)))
    if not seeds:
        raise ValueError("semisync: at least one seed")
    plan = sm.budget(quick, steps)
    if reach_steps is not None and reach_steps <= plan.steps:
        raise ValueError(f"semisync: reach_steps ({reach_steps}) must exceed the budget's {plan.steps} inner steps")
    longer = None if reach_steps is None else sm.budget(quick, reach_steps)
    names = sm.select(methods)
    cache = cache or os.path.join(out_dir, "cache")
    os.makedirs(cache, exist_ok=True)
    result = Result("semisync", f"Semi-synchronous training - the stdlib LM on {'/'.join(map(str, workers))} "
                    f"workers, {plan.steps} inner steps per method, loss against replayed wall time", list(COLUMNS))
    resolved = resolve(names, result, configs_dir)
    timeout = timeout or (900 if quick else 4 * 3600)
    _, data_path = lm_data.load(plan.vocab)
    if phase in ("train", "all"):
        train_phase(resolved, seeds, workers, plan, data_path, cache, timeout, show_progress)
        if longer is not None:
            train_phase(reaching(resolved), seeds, workers, longer, data_path, cache, timeout, show_progress)
    records = load_records(resolved, seeds, workers, plan, cache)
    extended = {} if longer is None else load_records(reaching(resolved), seeds, workers, longer, cache)
    missing = [f"{n} seed {s} workers {w}" for w in workers for n in resolved for s in seeds
               if len(records.get(w, {}).get(n, [])) <= seeds.index(s)]
    if missing:
        result.notes.append(f"not trained yet (run --phase train): {', '.join(missing)}")
    if phase in ("time", "all"):
        available, why = namespaces_available()
        if not available:
            result.notes.append(f"time phase SKIPPED: network namespaces are unavailable ({why}); it needs "
                                "root with iproute2")
        elif phase == "time" or not all(_covers(cache, w, plan, records.get(w, {})) for w in workers):
            time_phase(resolved, records, workers, plan, data_path, cache, timeout)
    timing = {}
    for world in workers:
        if os.path.exists(time_path(cache, world, plan)):
            with open(time_path(cache, world, plan), encoding="utf-8") as handle:
                timing[world] = json.load(handle)
    curves = combine(result, records, timing, resolved, extended)
    notes(result, records, timing, plan, seeds)
    if longer is not None:
        replay_runs.reach_note(result, records, extended, plan.steps, longer.steps, "inner steps", "step_to_ddp",
                               lambda world: f"{world} workers: ")
    targets(result, records)
    result.extra.update(budget=asdict(plan), seeds=seeds, workers=workers, curves=curves,
                        methods={n: m for n, m in resolved.items()})
    plot(result, curves, out_dir)
    return result


def combine(result: Result, records: Dict[int, Dict[str, List[dict]]], timing: Dict[int, dict],
            methods: Dict[str, dict], extended: Optional[Dict[int, Dict[str, List[dict]]]] = None) -> Dict[str, dict]:
    """The table's rows (into ``result``) and the mean loss curves against wall time, per workers;
    times to DDP's final loss (and the curves) from the ``extended`` runs of a row where it has
    them for every seed of its equal-token runs."""
    curves: Dict[str, dict] = {}
    for world, runs in records.items():
        if sm.BASELINE not in runs:
            result.notes.append(f"{world} workers: no {sm.BASELINE} run, the baseline of every comparison")
            continue
        timed_runs = replay_runs.timed(runs, (extended or {}).get(world))
        clocks = _clocks(timed_runs, timing.get(world), methods)
        ddp_loss, _ = rp.mean_spread([r["curve"][-1]["val_loss"] for r in runs[sm.BASELINE]])
        reach = {name: {net: replay_runs.reach(seeds, clocks.get(name, {}).get(net), ddp_loss) for net, _ in BANDWIDTHS}
                 for name, seeds in timed_runs.items()}
        for name, seeds in runs.items():
            loss, spread = rp.mean_spread([r["curve"][-1]["val_loss"] for r in seeds])
            params, steps = seeds[0]["parameters"], seeds[0]["steps"]
            row = {"workers": world, "method": name, "final_loss": loss, "spread": spread,
                   "vs_ddp_pct": 100 * (loss / ddp_loss - 1),
                   "sent_bppis": _bits(seeds, "sent_bytes", params, steps),
                   "recv_bppis": _bits(seeds, "received_bytes", params, steps),
                   "outer_steps": seeds[0]["outer_steps"],
                   "step_to_ddp": replay_runs.step_to(timed_runs[name], ddp_loss)}
            for net, _ in BANDWIDTHS:
                t = reach[name][net]
                row[f"t_{net}"] = t
                for col, ref in (("ddp", sm.BASELINE), ("topk", sm.PER_STEP_BEST)):
                    base = reach.get(ref, {}).get(net)
                    row[f"x_{col}_{net}"] = base / t if (t and base) else None
            result.rows.append(row)
            curves[f"{world}/{name}"] = replay_runs.mean_curve(timed_runs[name], clocks.get(name, {}))
    return curves


def _bits(seeds: List[dict], key: str, params: int, steps: int) -> float:
    per_rank = [rp.bits_per_parameter_step(b, params, steps) for r in seeds for b in r[key]]
    return sum(per_rank) / len(per_rank)


def _clocks(runs: Dict[str, List[dict]], timing: Optional[dict], methods: Dict[str, dict]) -> Dict[str, dict]:
    """``{method: {net: [wall clock per step, per seed]}}``; a streaming DiLoCo row overlaps its delay."""
    return replay_runs.clocks(runs, timing, BANDWIDTHS,
                              lambda name: methods[name].get("delay", 0) if methods[name]["kind"] == "diloco" else 0)


def notes(result: Result, records, timing, plan: sm.Budget, seeds: Sequence[int]) -> None:
    model = plan.model()
    any_run = next((r[0] for runs in records.values() for r in runs.values()), None)
    params = any_run["parameters"] if any_run else 0
    result.notes.append(
        f"model: {params / 1e6:.2f} M parameters (vocabulary {model.vocab_size}, width {model.width}, "
        f"{model.layers} layers, context {model.context}); {plan.steps} inner steps x {plan.batch} sequences x "
        f"{model.context} tokens per worker, AdamW lr {plan.lr} (warm-up {plan.warmup}), the same batches for "
        f"every method; seeds {', '.join(map(str, seeds))} (final_loss: mean, spread: half the range)")
    result.notes.append(
        "method: trained over loopback recording every step's messages, then replayed: wall time = measured "
        "compute per step (loopback profile on an idle machine, codec included) + the measured time of each "
        "message's real collective over a veth pair shaped with tc tbf (sizes between measured ones "
        "interpolated); evaluation excluded; t_<net> = wall time of the first evaluation at or below DDP fp32's "
        "final loss (mean over seeds, '-' if a seed never reaches it), x_ddp / x_topk = DDP's / lm_topk's time "
        "over that time")
    result.notes.append(
        "sent_bppis / recv_bppis: bits per parameter per inner step a rank hands to its collectives / the "
        "collectives deliver to it from the other ranks (an all-reduce delivers its result: the message size; "
        "a gather, the other ranks' messages), mean over ranks and seeds; a ring all-reduce puts 2(N-1)/N times "
        "the message on the wire each way, which the time phase measures")
    result.notes.append(
        "int8 rows: deepreduce's QSGD at 127 levels (int8 codes) with one float32 norm per 64 values, every "
        "entry, no error feedback (8.5 bits per value; stochastic L2-normalised rounding, not a per-tensor "
        "absmax int8: no such codec ships); ddp_fp16 stands for the issue's bf16 row: PyTorch's "
        "bf16_compress_hook refuses a CPU model (it requires CUDA 11+ and NCCL 2.10+), fp16_compress_hook sends "
        "the same 16 bits per value; "
        "DiLoCo outer optimizer Nesterov SGD lr 0.7 momentum 0.9; the DeMo-style, SparseLoCo-style and semisync "
        "rows average (SGD lr 1; semisync_1bit_h5 at lr 1.2): their error-feedback accumulators replace outer "
        "momentum")
    for world, entry in sorted(timing.items()):
        result.notes.append(f"{world} workers timed on {entry['cpus']} CPUs; qdisc {entry['qdisc'].get('10mbit', '')}")
    if not timing:
        result.notes.append("no time phase yet: the time columns are empty (run --phase time on an idle machine "
                            "as root with iproute2)")
    _received_note(result, records)


def _received_note(result: Result, records) -> None:
    """Received bytes per rank per outer step at 2 against 4 workers, gathering and sparse all-reduce rows."""
    if 2 not in records or 4 not in records:
        return
    parts = []
    for name in sm.GATHER_ROWS:
        two, four = records[2].get(name), records[4].get(name)
        if not two or not four or not two[0]["outer_steps"] or not four[0]["outer_steps"]:
            continue
        per = [sum(r["received_bytes"]) / len(r["received_bytes"]) / r["outer_steps"] for r in (two[0], four[0])]
        parts.append(f"{name} {per[0] / 1e3:.1f} kB -> {per[1] / 1e3:.1f} kB (x{per[1] / per[0]:.2f})")
    if parts:
        result.notes.append("received bytes per rank per outer step, 2 -> 4 workers: " + "; ".join(parts))


def targets(result: Result, records) -> None:
    """The issue's targets, met or missed by how much, as notes."""
    rows = {(r["workers"], r["method"]): r for r in result.rows}
    for world in sorted(records):
        semi = [rows[(world, n)] for n in sm.SHIPPED_SEMISYNC if (world, n) in rows]
        if not semi:
            continue
        good = [r for r in semi if r["vs_ddp_pct"] <= 100 * TOLERANCE and r["sent_bppis"] <= BITS_TARGET]
        text = ", ".join(f"{r['method']} {r['vs_ddp_pct']:+.1f}% at {r['sent_bppis']:.4f} bppis" for r in semi)
        result.notes.append(f"{world} workers, target within 2% of DDP at <= {BITS_TARGET} bppis: "
                            f"{'met by ' + ', '.join(r['method'] for r in good) if good else 'MISSED'} ({text})")
        fast = [r for r in semi if (r["x_ddp_10mbit"] or 0) >= 20 and (r["x_topk_10mbit"] or 0) >= 3]
        if any(r["t_10mbit"] is not None for r in semi):
            text = ", ".join(f"{r['method']} x{r['x_ddp_10mbit'] or 0:.1f} DDP, x{r['x_topk_10mbit'] or 0:.1f} lm_topk"
                             for r in semi)
            result.notes.append(f"{world} workers, target >= 20x DDP and >= 3x lm_topk at 10 Mbit/s: "
                                f"{'met' if fast else 'MISSED'} ({text})")
        loco = rows.get((world, "sparseloco_h30"))
        if loco is not None:
            text = ", ".join(f"{r['method']} {r['sent_bppis']:.4f} bppis at {r['final_loss']:.4f}" for r in semi)
            result.notes.append(f"{world} workers, SparseLoCo-style {loco['sent_bppis']:.4f} bppis at "
                                f"{loco['final_loss']:.4f}; deepreduce: {text}")


def plot(result: Result, curves: Dict[str, dict], out_dir: str) -> None:
    plt = pyplot()
    if plt is None:
        no_plot_note(result)
        return
    if not curves:
        return
    worlds = sorted({int(k.split("/")[0]) for k in curves})
    timed = any("time_10mbit" in c for c in curves.values())
    columns = [f"time_{net}" for net, _ in BANDWIDTHS] if timed else ["step"]
    fig, axes = plt.subplots(len(worlds), len(columns), figsize=(6.5 * len(columns), 4.5 * len(worlds)),
                             squeeze=False)
    for row, world in enumerate(worlds):
        mine = {key.split("/", 1)[1]: curve for key, curve in curves.items() if int(key.split("/")[0]) == world}
        for col, xkey in enumerate(columns):
            title = f"{world} workers" + (f", {xkey[5:]}" if timed else " (no time phase yet)")
            replay_runs.draw_curves(axes[row][col], mine, xkey, lambda name: sm.spec(name)["kind"] == "ddp",
                                    "inner step", title)
    save_figure(result, fig, out_dir, "semisync_loss_vs_time.png")
