"""``deepreduce bench-scaling --sync-every``: the sync period H as a third choice.

For each model, link and rank count, one row per way to reduce the pseudo-gradient (dense fp32,
bf16 and int8 all-reduces; every measured config through the allgather and the sparse
all-reduce) with its predicted step time at each candidate H, the smallest H within the slack of
the compute alone (``H*``, :func:`deepreduce.collective.sync_period.choose` per row) and the bits
per parameter per inner step one rank sends there; then the planner's pick over all rows. The
model: :mod:`deepreduce.collective.sync_period` (DiLoCo's wall-clock model with Streaming DiLoCo's
overlap ``--sync-delay``).
"""
from __future__ import annotations

import math
from typing import Sequence

#: Links where semi-synchronous training is used: a volunteer's uplink to a data-centre fabric.
DEFAULT_GBITS = (0.01, 0.1, 1.0, 10.0)
DEFAULT_RANKS = (2, 8, 64)


def options(codecs) -> list:
    from deepreduce.collective.sync_period import DENSE_ITEMSIZE, OuterOption

    dense = [OuterOption(name) for name in DENSE_ITEMSIZE]
    return dense + [OuterOption(agg, c) for c in codecs for agg in ("allgather", "sparse_allreduce")]


def print_tables(models: Sequence[str], specs: dict, codecs, candidates: Sequence[int], gbits: Sequence[float],
                 ranks: Sequence[int], alpha_s: float, slack: float, delay: int) -> None:
    """Print one table per (model, link, N); see the module docstring."""
    from deepreduce.collective.cost_model import Link
    from deepreduce.collective.sync_period import choose, predict

    rows = options(codecs)
    width = max(9, *(len(o.label) for o in rows))
    for name in models:
        spec = specs[name]
        numel = sum(math.prod(s) for _, s in spec.shapes())
        compute = spec.forward_s + spec.backward_s
        for gbit in gbits:
            link = Link.from_gbit(gbit, alpha_s)
            for n in ranks:
                print(f"\n{spec.title}, {numel:,} parameters, {gbit:g} Gbit/s, N = {n}: predicted inner step ms "
                      f"(compute {1e3 * compute:.0f} ms) per sync period H; H* = the smallest within "
                      f"{100 * slack:g}% of compute (delay {delay})")
                header = f"{'option':<{width}} " + " ".join(f"{'H=' + str(h):>9}" for h in candidates) \
                    + f" {'H*':>5} {'ms at H*':>9} {'bits/param/step':>16}"
                print(header)
                print("-" * len(header))
                for option in rows:
                    steps = [predict(option, link, n, numel, compute, h, delay).step_s for h in candidates]
                    best = choose([option], link, n, numel, compute, candidates, slack, delay)
                    print(f"{option.label:<{width}} " + " ".join(f"{1e3 * s:>9.1f}" for s in steps)
                          + f" {best.sync_every:>5} {1e3 * best.step_s:>9.1f} {best.sent_bits_per_param:>16.4g}")
                pick = choose(rows, link, n, numel, compute, candidates, slack, delay)
                print(f"planner: {pick.option} every {pick.sync_every} steps, {1e3 * pick.step_s:.1f} ms per inner step, "
                      f"{pick.sent_bits_per_param:.4g} bits per parameter per inner step sent")
