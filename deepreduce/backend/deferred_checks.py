"""The validity checks of a decode on a torch device, read back in one synchronisation.

A decode checks what it receives: values finite unless the header says otherwise, indices
distinct and in range, a sum that does not overflow under ``nonfinite='raise'``. On NumPy each
check is a pass over host memory; on an accelerator each would read a flag back to the host, a
stream synchronisation per check and container (a GPU profile of the device path counted about
eight per decode, most of them these). Here each check of a torch decode is kept as a 0-d boolean
tensor on the device, and :meth:`DeferredChecks.settle` reads them all in one copy at the end and
raises the error of the first that failed, in the order the checks were made: the same error the
immediate check raises, so a caller cannot tell the two apart except by the time they take.

Until then the decode must stay harmless on any input: :func:`in_range` clamps scatter
positions into the tensor (an out-of-range position would abort the device), and a repeated
position only adds twice into a buffer the raised error discards.
"""
from __future__ import annotations

from typing import Callable, List, Tuple

from ..errors import DeepReduceError
from . import arrays


class DeferredChecks:
    """Checks of one decode call; ``expect(ok, error)`` records one, ``settle()`` reads them all.

    ``context`` (e.g. ``"rank 1: "``) prefixes the message of the errors recorded after it is set,
    as :meth:`deepreduce.Pipeline.decode_sum` names the rank whose container failed.
    """

    def __init__(self) -> None:
        self.context = ""
        self._checks: List[Tuple[object, Callable[[], DeepReduceError], str]] = []

    def expect(self, ok, error: Callable[[], DeepReduceError]) -> None:
        """Record a check: ``ok`` a boolean torch tensor (one element) that is True when the data
        passes, ``error`` makes the exception to raise when it does not."""
        self._checks.append((ok, error, self.context))

    def settle(self) -> None:
        """Read every recorded check (one device-to-host copy) and raise the first failure's error."""
        if not self._checks:
            return
        flags = [ok for ok, _, _ in self._checks]
        passed = arrays.adapter(flags[0]).read_flags(flags)
        checks, self._checks = self._checks, []
        for ok, (_, error, context) in zip(passed, checks):
            if not ok:
                exc = error()
                raise type(exc)(f"{context}{exc}")


def in_range(indices, numel: int):
    """``indices`` clamped into ``[0, numel)``: safe to scatter before their range check is read."""
    return indices.clamp(0, max(numel - 1, 0))
