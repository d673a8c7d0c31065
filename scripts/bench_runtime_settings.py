"""Forward / backward / step time of the main job's dense baseline under each launcher setting.

Runs ``python -m experiments.train --baseline --profile`` on 2 ranks under torchrun (DDP over
gloo) and under horovodrun with each runtime setting, round-robin for ``--rounds`` rounds, and
prints the median per-step milliseconds of the last epoch (the first one warms up) of every
run, their median over rounds, and the forward time relative to torchrun's::

    .venv/bin/python scripts/bench_runtime_settings.py --rounds 3

Every horovodrun variant states the Open MPI yield setting explicitly, so the project's default
(:mod:`experiments.runtime`) does not silently apply to the variants meant to run without it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.reproduce.fig7 import kill_tree  # noqa: E402

BIN = os.path.dirname(sys.executable)
# launcher prefixes up to the module to run (torchrun starts the interpreter itself)
HOROVODRUN = [os.path.join(BIN, "horovodrun"), "-np", "2", "-H", "localhost:2", sys.executable]
TORCHRUN = [os.path.join(BIN, "torchrun"), "--standalone", "--nproc-per-node", "2"]
NO_YIELD = {"OMPI_MCA_mpi_yield_when_idle": "0"}
YIELD = {"OMPI_MCA_mpi_yield_when_idle": "1"}

# name -> (launcher prefix, environment overrides)
VARIANTS: Dict[str, Tuple[List[str], Dict[str, str]]] = {
    "torchrun-ddp-gloo": (TORCHRUN, {}),
    "hvd-ompi-defaults": (HOROVODRUN, NO_YIELD),
    "hvd-yield": (HOROVODRUN, YIELD),
    "hvd-yield-cycle5": (HOROVODRUN, {**YIELD, "HOROVOD_CYCLE_TIME": "5"}),
    "hvd-yield-cycle20": (HOROVODRUN, {**YIELD, "HOROVOD_CYCLE_TIME": "20"}),
    "hvd-cycle20": (HOROVODRUN, {**NO_YIELD, "HOROVOD_CYCLE_TIME": "20"}),
    "hvd-gloo": (HOROVODRUN[:1] + ["--gloo"] + HOROVODRUN[1:], {}),
}


def describe(name: str) -> str:
    launcher, overrides = VARIANTS[name]
    flags = [arg for arg in launcher if arg == "--gloo"]
    return " ".join([os.path.basename(launcher[0])] + flags + [f"{k}={v}" for k, v in overrides.items()])


def run_variant(name: str, steps: int, out_dir: str, timeout: float) -> Dict[str, float]:
    launcher, overrides = VARIANTS[name]
    metrics = os.path.join(out_dir, "metrics.json")
    cmd = launcher + ["-m", "experiments.train", "--baseline", "--profile", "--epochs", "2",
                      "--max-steps", str(steps), "--metrics-json", metrics]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **overrides)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.communicate()
        raise SystemExit(f"{name}: ran past {timeout:.0f}s")
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exited {proc.returncode}\n{output[-3000:]}")
    with open(metrics, encoding="utf-8") as handle:
        return json.load(handle)["epochs"][-1]["step_ms"]["dense"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20, help="steps per epoch (2 epochs, the last is measured)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variant names")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    runs: Dict[str, List[Dict[str, float]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as out_dir:
        for round_ in range(args.rounds):
            for name in names:
                runs[name].append(run_variant(name, args.steps, out_dir, args.timeout))
                ms = runs[name][-1]
                print(f"round {round_ + 1} {name:20s} forward {ms['forward']:7.2f} backward {ms['backward']:7.2f} "
                      f"step {ms['step']:7.2f} total {ms['total']:7.2f} ms", flush=True)
    reference = names[0]
    print(f"\n{'variant':20s} {'forward':>8s} {'backward':>9s} {'step':>8s} {'total':>8s}  fwd/{reference}  env")
    medians = {n: {k: statistics.median(r[k] for r in runs[n]) for k in runs[n][0]} for n in names}
    for name in names:
        ms = medians[name]
        print(f"{name:20s} {ms['forward']:8.2f} {ms['backward']:9.2f} {ms['step']:8.2f} {ms['total']:8.2f}  "
              f"{ms['forward'] / medians[reference]['forward']:.3f}  {describe(name)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
