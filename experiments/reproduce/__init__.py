"""Reproductions of the DeepReduce paper's experiments (Figs. 6, 7, 10, 11 and Table 2), quality
(time to accuracy of a language model over a shaped link), semisync (semi-synchronous training
against every-step compression, replayed over a shaped link) and hsdp (FSDP2 as HSDP on two
"nodes": native HSDP against deepreduce on the replicate dimension, replayed over a shaped link).

One module per experiment, each with ``run(out_dir, quick=False, ...) -> Result``; the command
``python -m deepreduce reproduce <experiment> --out DIR`` runs one, prints its table and writes
the table (Markdown, JSON) and PNG plots into ``DIR``. ``--quick`` runs on tiny inputs (what the
tests use); the full runs are benchmarks (see docs/benchmarks.md).
"""
from __future__ import annotations

import importlib

EXPERIMENTS = ("fig6", "fig10", "table2", "fig7", "fig11", "quality", "semisync", "hsdp")


def get(name: str):
    """The module of experiment ``name``."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; available: {', '.join(EXPERIMENTS)}")
    return importlib.import_module(f"{__name__}.{name}")
