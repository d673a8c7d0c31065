"""Undo for a skipped step: what one step's encodes changed in a pipeline.

Under ``nonfinite: raise`` every rank skips a step in which any rank's gradient was non-finite
(:mod:`deepreduce.collective.agreement` takes that decision collectively); the pipeline must then be
as it was before the step. The journal keeps what an encode changes the first time it changes
it in a step, and puts it back on :meth:`StepJournal.undo`.
"""
from __future__ import annotations

import copy
from typing import Optional


class StepJournal:
    """What one step's encodes changed in a pipeline, so that a step every rank skips is undone.

    Before a tensor's first encode since the last :meth:`commit`, the journal takes its
    error-feedback residual's snapshot (``Memory.snapshot``: the residual array itself, which the
    memory then leaves intact and writes the step into a second buffer, so no copy is made) and,
    once per step, the sparsifier's and codecs' learned state (SIDCo stage counts; small).
    :meth:`undo` puts all of it back; :meth:`commit` releases the snapshots.
    """

    _COMPONENTS = ("sparsifier", "index", "value")

    def __init__(self, pipeline) -> None:
        self._memory = pipeline.memory
        self._components = [getattr(pipeline, kind) for kind in self._COMPONENTS]
        self._residuals: dict = {}
        self._states: Optional[list] = None

    def save(self, name: str) -> None:
        """Remember ``name``'s residual (and the components' state) before an encode changes them."""
        if self._states is None:
            self._states = [copy.deepcopy(c.state_dict()) for c in self._components]
        if self._memory.stateful and name not in self._residuals:
            self._residuals[name] = self._memory.snapshot(name)

    def commit(self) -> None:
        """The step was applied: forget what it changed."""
        for name, saved in self._residuals.items():
            self._memory.release(name, saved)
        self._residuals.clear()
        self._states = None

    def undo(self) -> None:
        """The step was skipped: restore every residual and state it changed."""
        for name, saved in self._residuals.items():
            self._memory.restore(name, saved)
        if self._states is not None:
            for component, state in zip(self._components, self._states):
                component.load_state_dict(state)
        self._residuals.clear()
        self._states = None
