"""The end of a step for the bindings not yet on the step engine (the DDP hook).

:func:`end_step` commits or undoes the step through the protocol and raises its first error.
The Horovod optimizer and the TF reducer's host routes end their steps in
:class:`deepreduce.collective.step.StepEngine`, which replaced this module's ``InFlight``.
"""
from __future__ import annotations

from typing import Optional, Sequence


def end_step(protocol, step: int, errors: Sequence[BaseException], order: Optional[Sequence[str]] = None) -> None:
    """After the step's last collective: the protocol commits or undoes the step and raises its
    first error (:meth:`~deepreduce.collective.protocol.ReductionProtocol.end_step`); without one (a
    summable compressor keeps no residuals) the first of ``errors`` is raised."""
    if protocol is not None:
        protocol.end_step(step, errors, order)
    elif errors:
        raise errors[0]
