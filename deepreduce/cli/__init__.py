"""The ``deepreduce`` command line: one sub-command per module of this package, plus those of the
installed plugins, found through the entry point group ``deepreduce.commands``.

Each module ``deepreduce/cli/<name>.py`` defines ``register(subparsers)`` that adds its parser and
sets ``func``; new commands need no change here. A plugin is a distribution whose entry point in
:data:`COMMANDS` names a callable of the same signature. The library never names a plugin: the
experiment harness (benchmarks, reproductions) declares its ``register`` there when ``make setup``
sets up a development checkout (scripts/harness/pyproject.toml), so a plain ``pip install`` ships
only the library's own commands (``inspect``) and the library never imports the harness.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from importlib.metadata import EntryPoint, entry_points
from typing import List, Optional

#: The entry point group whose entries add sub-commands: ``name = "module:register"``.
COMMANDS = "deepreduce.commands"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepreduce", description="DeepReduce gradient compression tools")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}").register(subparsers)
    for entry in plugins():
        register = load_plugin(entry)
        if register is not None:
            register(subparsers)
    return parser


def plugins() -> List[EntryPoint]:
    """The installed entry points of :data:`COMMANDS`, by name (one distribution each: the first
    on ``sys.path`` wins, as for imports)."""
    return sorted(entry_points(group=COMMANDS), key=lambda entry: entry.name)


def load_plugin(entry: EntryPoint):
    """The ``register`` callable an entry point names, or None (with a note on stderr that says
    which plugin and why) when its module cannot be imported, e.g. a development checkout that was
    moved or deleted: the other commands keep working. A plugin that imports but fails otherwise
    raises, as any bug does."""
    try:
        return entry.load()
    except ImportError as exc:
        dist = entry.dist.name if entry.dist is not None else "an unknown distribution"
        print(f"deepreduce: skipping the commands of plugin {entry.name!r} ({entry.value}, installed by {dist}): "
              f"{exc}. Re-run `make setup` in its checkout, or `pip uninstall {dist}`.", file=sys.stderr)
        return None


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
