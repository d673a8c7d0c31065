"""The ways a tensor travels, one file each, and their registry.

A route owns a tensor's whole life in one step. The step engine
(:class:`deepreduce.collective.step.StepEngine`) calls, for every item the binding submits:

* ``start(engine, item)`` on the engine's worker, as the gradient arrives: select and encode,
  start the route's first collective; returns what ``settle`` and ``finish`` need. It may raise:
  the engine then calls ``fail(engine, item, error)``, which starts the same collectives with
  the failure payload (:mod:`deepreduce.collective.failure`), so every rank stays in phase;
* ``settle(engine, item, started)`` in the canonical order on every rank, after backward: the
  middle phases; default: nothing. Then ``settle_all(engine, items)`` with the route's items
  of the step, for a route whose items share collectives (the sparse all-reduce: one alltoall,
  the owner steps, one collective back, for every item); default: nothing;
* ``finish(engine, item, started) -> Outcome``: wait for the last collective, read the flags
  (a peer's failure raises here; a non-finite payload is reported in ``Outcome.nonfinite``) and
  return how to write the sum. The engine, not the route, applies the ``nonfinite`` policy,
  averages (``Outcome.write(divisor)``), and commits or undoes (``commit()``/``undo()``).

``ORDER`` sorts items on every rank before ``settle``/``finish``: routes whose collectives are
matched by name (Horovod) first, then those that run collectives in a fixed order.
Adding a route: one file here with a class implementing the above, and one line in :data:`ROUTES`.
"""
from __future__ import annotations

from typing import Dict

from ._base import Outcome, Route
from .allgather import Allgather
from .dense import Dense, Fp16
from .entries import Entries
from .shard import Shard
from .sparse_allreduce import SparseAllreduceRoute
from .summable import Summable

__all__ = ["Outcome", "Route", "ROUTES", "registry"]

#: Route id -> class: every way a tensor travels.
ROUTES: Dict[str, type] = {cls.id: cls for cls in (Allgather, SparseAllreduceRoute, Dense, Fp16, Entries, Summable)}
ROUTES[Shard.id] = Shard   # the compressed reduce-scatter (deepreduce.torch.fsdp); a binding names it in Item.route


def registry() -> Dict[str, type]:
    """:data:`ROUTES` (a copy)."""
    return dict(ROUTES)
