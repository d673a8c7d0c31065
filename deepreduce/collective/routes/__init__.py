"""The ways a tensor travels, one file each, and their registry.

A route owns a tensor's whole life in one step. The step engine
(:class:`deepreduce.collective.step.StepEngine`) calls, for every item the binding submits:

* ``start(engine, item)`` on the engine's worker, as the gradient arrives: select and encode,
  start the route's first collective; returns what ``settle`` and ``finish`` need. It may raise:
  the engine then calls ``fail(engine, item, error)``, which starts the same collectives with
  the failure payload (:mod:`deepreduce.collective.failure`), so every rank stays in phase;
* ``settle(engine, item, started)`` in the canonical order on every rank, after backward: the
  middle phases (the sparse all-reduce's owner step and its allgather's start); default: nothing;
* ``finish(engine, item, started) -> Outcome``: wait for the last collective, read the flags
  (a peer's failure raises here; a non-finite payload is reported in ``Outcome.nonfinite``) and
  return how to write the sum. The engine, not the route, applies the ``nonfinite`` policy,
  averages (``Outcome.write(divisor)``), and commits or undoes (``commit()``/``undo()``).

``ORDER`` sorts items on every rank before ``settle``/``finish``: routes whose collectives are
matched by name (Horovod) first, then those that run collectives in a fixed order.
Adding a route: one file here with a class implementing the above, and one line in :data:`ROUTES`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

Found = Tuple[int, int, int]   # (rank, NaN count, Inf count) of a flagged payload


@dataclass
class Outcome:
    """What a route's ``finish`` hands the engine: ``nonfinite``, the first flagged payload's
    report (or None); ``write(divisor)`` writes the sum divided by ``divisor`` into the item's
    destination (under ``nonfinite: raise`` the engine never calls it for a flagged tensor)."""

    write: Callable[[int], None]
    nonfinite: Optional[Found] = None


class Route:
    """Base of the routes: the defaults of the interface described in the module docstring."""

    id = ""
    ORDER = 0

    def settle(self, engine, item, started):
        return started

    def commit(self) -> None:
        """The step was applied on every rank: keep what it changed in this route's state."""

    def undo(self) -> None:
        """The step was skipped on every rank: restore this route's state from before it."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output."""

    def stats(self) -> dict:
        return {}


def registry() -> Dict[str, type]:
    """Route id -> class (imported here, not at module level: the routes import the engine's helpers)."""
    from .allgather import Allgather
    from .dense import Dense, Fp16
    from .entries import Entries
    from .sparse_allreduce import SparseAllreduceRoute
    from .summable import Summable

    return {cls.id: cls for cls in (Allgather, SparseAllreduceRoute, Dense, Fp16, Entries, Summable)}
