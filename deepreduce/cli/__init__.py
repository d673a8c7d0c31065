"""The ``deepreduce`` command line: one sub-command per module of this package.

Each module ``deepreduce/cli/<name>.py`` defines ``register(subparsers)`` that adds its parser
and sets ``func``; new commands need no change here.
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
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}").register(subparsers)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
