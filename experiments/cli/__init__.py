"""Sub-commands of the ``deepreduce`` command line that belong to the harness (benchmarks,
reproductions, gradient capture).

Each public module defines ``register(subparsers)``; :func:`register` adds them all. The library
never imports this package: the metadata-only distribution ``deepreduce-experiments``
(scripts/harness/pyproject.toml, installed by ``make setup``) names :func:`register` in the entry
point group ``deepreduce.commands``, which ``deepreduce.cli`` reads.
"""
from __future__ import annotations

import importlib
import pkgutil


def register(subparsers) -> None:
    """Add the command of every public module of this package (a new module needs no change here)."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}").register(subparsers)
