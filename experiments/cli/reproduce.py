"""``deepreduce reproduce <experiment> --out DIR [--quick]``: rerun one of the paper's experiments.

Prints the experiment's table, writes ``<experiment>.md``/``.json`` and its PNG plots into
``DIR``. Experiments: fig6 (Bloom policies vs FPR), fig10 (per-config volume and time on one
ResNet-20 layer), table2 (inherently sparse recommender), fig7 (2-rank convergence), fig11
(time per iteration over a shaped network between two network namespaces; needs root), quality
(time to accuracy of a language model over the same shaped network; needs root), semisync
(semi-synchronous training against every-step compression: trained over loopback, then replayed
over the shaped network; ``--phase train`` runs anywhere, ``--phase time`` needs root), hsdp
(FSDP2 as HSDP on 2 nodes x 2 ranks, native HSDP against deepreduce, replayed over the shaped
network between the nodes; the same phases).
"""
from __future__ import annotations

import inspect
import time


def register(subparsers) -> None:
    from ..reproduce import EXPERIMENTS

    parser = subparsers.add_parser("reproduce", help="reproduce a paper experiment: table + plots")
    parser.add_argument("experiment", choices=EXPERIMENTS)
    parser.add_argument("--out", required=True, help="directory for the table and the plots")
    parser.add_argument("--quick", action="store_true", help="a short version: tiny inputs or budgets, seconds to a few minutes")
    parser.add_argument("--epochs", type=int, default=None, help="fig7: epochs per configuration")
    parser.add_argument("--configs", default=None, help="fig10: directory of YAML configs (default: the repository's configs/)")
    parser.add_argument("--iterations", type=int, default=None, help="fig11: measured iterations per run")
    parser.add_argument("--accumulate", type=int, default=None,
                        help="fig11: micro-batches accumulated per iteration (the paper uses 10)")
    parser.add_argument("--methods", default=None,
                        help="fig7, quality, semisync, hsdp: comma-separated methods to run (default: all)")
    parser.add_argument("--steps", type=int, default=None, help="quality, semisync, hsdp: training steps per method")
    parser.add_argument("--reach-steps", type=int, default=None,
                        help="semisync: also continue DDP (fp32, fp16), lm_topk and the shipped semi-synchronous rows to this many "
                             "inner steps and read their time to DDP's final loss from those runs; hsdp: the same for "
                             "HSDP fp32 and bf16, lm_qsgd and the recommended rows, to HSDP fp32's final loss")
    parser.add_argument("--seeds", default=None, help="semisync, hsdp: comma-separated seeds (default 0,1; quick: 0)")
    parser.add_argument("--workers", default=None, help="semisync: comma-separated worker counts (default 2,4)")
    parser.add_argument("--nodes", type=int, default=None,
                        help="hsdp: nodes of 2 ranks (default 2; more: --phase train only, bytes and loss)")
    parser.add_argument("--phase", default=None, choices=("train", "time", "all"),
                        help="semisync, hsdp: train (cached, any machine), time (idle machine, root), all (default)")
    parser.add_argument("--cache", default=None, help="semisync, hsdp: directory of the cached runs (default OUT/cache)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def _ints(text, flag: str):
    """``"0,1"`` -> ``[0, 1]`` (None stays None); anything else is a clear error."""
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"deepreduce reproduce: {flag} takes comma-separated integers, got {text!r}") from None


def run(args) -> int:
    from ..reproduce import get

    module = get(args.experiment)
    if args.nodes is not None and args.nodes < 2:
        raise SystemExit(f"deepreduce reproduce: --nodes takes a whole number of nodes >= 2, got {args.nodes}")
    options = {"quick": args.quick, "show_progress": not args.no_progress}
    wanted = {"epochs": args.epochs, "configs_dir": args.configs, "iterations": args.iterations,
              "accumulate": args.accumulate, "steps": args.steps, "reach_steps": args.reach_steps,
              "phase": args.phase, "cache": args.cache,
              "seeds": _ints(args.seeds, "--seeds"), "workers": _ints(args.workers, "--workers"), "nodes": args.nodes,
              "methods": [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None}
    accepted = inspect.signature(module.run).parameters
    ignored = [k for k, v in wanted.items() if v is not None and k not in accepted]
    if ignored:
        flags = ", ".join("--" + ("configs" if k == "configs_dir" else k.replace("_", "-")) for k in ignored)
        raise SystemExit(f"deepreduce reproduce {args.experiment}: {flags} does not apply to this experiment")
    options.update({k: v for k, v in wanted.items() if v is not None and k in accepted})
    start = time.perf_counter()
    result = module.run(args.out, **options)
    files = result.write(args.out)
    result.print()
    for path in files:
        print(f"table: {path}")
    print(f"{args.experiment}: done in {time.perf_counter() - start:.1f}s")
    return 0
