"""What every route implements (see :mod:`deepreduce.collective.routes`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

Found = Tuple[int, int, int]   # (rank, NaN count, Inf count) of a flagged payload


@dataclass
class Outcome:
    """What a route's ``finish`` hands the engine: ``nonfinite``, the first flagged payload's
    report (or None), ``part`` the name of the flagged part where the route knows it (else the
    item's name is reported); ``write(divisor)`` writes the sum divided by ``divisor`` into the
    item's destination (under ``nonfinite: raise`` the engine never calls it for a flagged item)."""

    write: Callable[[int], None]
    nonfinite: Optional[Found] = None
    part: str = ""


class Route:
    """Base of the routes: the defaults of the interface described in the module docstring."""

    id = ""
    ORDER = 0

    def settle(self, engine, item, started):
        return started

    def settle_all(self, engine, items) -> None:
        """After every item's ``settle``: the route's items of the step (canonical order, each
        one's ``started`` set), for a route whose items share collectives; default: nothing."""

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
