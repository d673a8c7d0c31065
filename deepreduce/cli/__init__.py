"""The ``deepreduce`` command line: one sub-command per module of this package, plus those of the
experiment harness (``experiments.cli``: benchmarks, reproductions) when it is importable.

Each module ``<package>/<name>.py`` defines ``register(subparsers)`` that adds its parser and
sets ``func``; new commands need no change here. A plain ``pip install`` ships only the library's
own commands (``inspect``).
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from typing import List, Optional


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepreduce", description="DeepReduce gradient compression tools")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for package in command_packages():
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
            if not info.name.startswith("_"):
                importlib.import_module(f"{package.__name__}.{info.name}").register(subparsers)
    return parser


def command_packages() -> list:
    """This package, and ``experiments.cli`` where the harness is importable (a source checkout)."""
    packages = [sys.modules[__name__]]
    try:
        packages.append(importlib.import_module("experiments.cli"))
    except ModuleNotFoundError as exc:
        if exc.name not in ("experiments", "experiments.cli"):
            raise
    return packages


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
