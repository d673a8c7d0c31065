"""Shared machinery of the reproduction experiments: results, tables, plots, progress, configs.

Every experiment module exposes ``run(out_dir, quick=False, **options) -> Result``. A
:class:`Result` is printed as a Markdown table (the same text docs/benchmarks.md quotes) and
written to ``out_dir`` as ``<name>.md`` and ``<name>.json``; plots are PNG files next to them.
matplotlib and tqdm are optional extras: without tqdm the progress is a plain counter on
stderr; without matplotlib the tables are still produced and the result says why no plot was
drawn.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence

import numpy as np

from deepreduce.errors import ConfigError, DeepReduceError


@dataclass
class Result:
    """One experiment's outcome: a table (columns + row dicts), plot files and notes."""

    name: str
    title: str
    columns: List[str]
    rows: List[Dict[str, Any]] = field(default_factory=list)
    plots: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)

    def markdown(self) -> str:
        return markdown_table(self.columns, self.rows)

    def write(self, out_dir: str) -> List[str]:
        """Write ``<name>.md`` and ``<name>.json`` into ``out_dir``; return their paths."""
        os.makedirs(out_dir, exist_ok=True)
        md_path = os.path.join(out_dir, f"{self.name}.md")
        with open(md_path, "w", encoding="utf-8") as handle:
            handle.write(f"# {self.title}\n\n{self.markdown()}\n")
            for note in self.notes:
                handle.write(f"\n- {note}")
            handle.write("\n")
        json_path = os.path.join(out_dir, f"{self.name}.json")
        with open(json_path, "w", encoding="utf-8") as handle:
            json.dump({"name": self.name, "title": self.title, "columns": self.columns, "rows": self.rows,
                       "plots": [os.path.basename(p) for p in self.plots], "notes": self.notes,
                       "extra": self.extra}, handle, indent=2, default=_jsonable)
        return [md_path, json_path]

    def print(self, file=None) -> None:
        file = file or sys.stdout
        print(f"\n{self.title}\n", file=file)
        print(self.markdown(), file=file)
        for note in self.notes:
            print(f"note: {note}", file=file)
        for path in self.plots:
            print(f"plot: {path}", file=file)
        file.flush()


def leave(code: int) -> None:
    """End a worker process with ``code`` without running gloo's destructors: tearing down a TCP
    process group while the peer closes its end can abort the process ("terminate called without
    an active exception") after all work is done. Call it once every rank passed the final barrier."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _jsonable(obj):
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


def fmt(value: Any) -> str:
    """Cell text: 4 significant digits for floats, scientific for tiny ones."""
    if value is None:
        return "-"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if math.isnan(v):
            return "nan"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.4g}"
    return str(value)


def markdown_table(columns: Sequence[str], rows: Iterable[Dict[str, Any]]) -> str:
    """A GitHub-flavoured Markdown table of ``rows`` (dicts) restricted to ``columns``."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- progress
class _PlainProgress:
    """A minimal stand-in for tqdm: a counter on stderr every few seconds."""

    def __init__(self, iterable, desc: str, total: Optional[int]) -> None:
        self.iterable, self.desc, self.total = iterable, desc, total

    def __iter__(self):
        last = 0.0
        for i, item in enumerate(self.iterable, 1):
            yield item
            now = time.monotonic()
            if now - last > 5 or i == self.total:
                print(f"{self.desc}: {i}/{self.total or '?'}", file=sys.stderr, flush=True)
                last = now


def progress(iterable, desc: str, total: Optional[int] = None, enabled: bool = True):
    """Wrap ``iterable`` in a progress bar on stderr (tqdm when installed)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(iterable, desc, total)
    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, leave=False, dynamic_ncols=True)


class _PlainBar:
    """A minimal stand-in for a manual tqdm bar: ``update(n)`` prints a counter every few seconds."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.n, self._last = total, desc, 0, 0.0

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last > 5 or self.n >= self.total:
            print(f"{self.desc}: {self.n}/{self.total}", file=sys.stderr, flush=True)
            self._last = now

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool = True):
    """A bar advanced by ``update(n)`` (tqdm when installed), or None when disabled; ``close()`` it."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainBar(total, desc)
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)


# ---------------------------------------------------------------------------- plots
def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend, or None when not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(result: Result, fig, out_dir: str, filename: str) -> None:
    """Save ``fig`` as ``out_dir/filename`` and list it in ``result.plots``."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, filename)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    result.plots.append(path)


def no_plot_note(result: Result) -> None:
    result.notes.append("no plots: matplotlib is not installed (pip install 'deepreduce[plots]')")


# ---------------------------------------------------------------------------- configs
def default_configs_dir() -> str:
    """The repository's ``configs/`` (next to the package), else ``./configs``."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
    return here if os.path.isdir(here) else "configs"


def named_config(stem: str, result: "Result", configs_dir: Optional[str] = None) -> Optional[dict]:
    """The validated config ``configs/<stem>.yaml``, or None with the reason noted in ``result``.

    The experiments name the project's per-instantiation configs instead of repeating their
    parameters, so a config file is the one definition of each method.
    """
    from deepreduce.config import load_config

    path = os.path.join(configs_dir or default_configs_dir(), f"{stem}.yaml")
    try:
        return load_config(path)
    except (ConfigError, DeepReduceError, KeyError) as exc:
        result.notes.append(f"skipped {stem}: {exc}")
        return None


def try_build(config: dict, label: str, result: Result):
    """Build a pipeline, or record in ``result.notes`` why ``label`` is skipped and return None.

    The experiments name codecs that may not be installed in a given build (or whose
    parameters changed); they report and skip such a configuration instead of failing.
    """
    from deepreduce.config import build

    try:
        return build(config)
    except (ConfigError, DeepReduceError, KeyError) as exc:
        result.notes.append(f"skipped {label}: {exc}")
        return None


def with_sparsifier(config: dict, sparsifier: dict) -> dict:
    """``config`` with its sparsifier replaced, no error feedback and no dense small tensors."""
    return dict(config, sparsifier=dict(sparsifier), memory={"id": "none"}, min_numel=0)


def sparse_target(pipe, flat: np.ndarray, name: str, step: int) -> np.ndarray:
    """The sparsifier's output as a dense vector (what the codecs are asked to carry)."""
    target = np.zeros_like(flat)
    chosen = pipe.sparsifier.select(flat, pipe.context(name, step))
    target[chosen] = flat[chosen]
    return target


class ErrorAccumulator:
    """Relative L2 error over many tensors: ``sqrt(sum ||x - y||^2 / sum ||y||^2)``."""

    def __init__(self) -> None:
        self.num = 0.0
        self.den = 0.0

    def add(self, got: np.ndarray, want: np.ndarray) -> None:
        self.num += float(np.sum((got.astype(np.float64) - want) ** 2))
        self.den += float(np.sum(want.astype(np.float64) ** 2))

    @property
    def value(self) -> float:
        return math.sqrt(self.num / self.den) if self.den else 0.0
