"""The failure payload: what a rank whose encode raised sends in place of its data.

Every rank's collective still completes, so no rank waits forever; every peer that reads it
raises (a NonFiniteGradientError for a non-finite gradient, as the README's skip-the-step
pattern catches, else a CommunicationError naming the rank), and the rank raises its own
error. The step is undone everywhere and the next one is in phase. One definition for every
route and binding.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from ..backend import arrays
from ..errors import CommunicationError, NonFiniteGradientError
from . import agreement

FAILED = b"\xffdeepreduce: encode failed\xff"   # opens the payload of a rank whose encode raised


def on_host(payload):
    """A payload to read byte by byte: a torch tensor (on any device) copied to the host in one
    transfer, as a uint8 NumPy array (reading a device tensor's elements one by one costs a
    device synchronisation each); anything else as it is."""
    if not arrays.is_torch(payload):
        return payload
    return np.frombuffer(arrays.head_bytes(payload, len(payload)), dtype=np.uint8)


def payload(exc: BaseException) -> np.ndarray:
    """The failure payload for ``exc`` (see the module docstring)."""
    kind = "nonfinite" if isinstance(exc, NonFiniteGradientError) else "error"
    text = f"{kind}\n{type(exc).__name__}: {exc}"[:500]
    return agreement.wrap_bytes(FAILED + text.encode("utf-8", "replace"))


def failed_rank(payloads: Sequence) -> Optional[Tuple[int, str, str]]:
    """(rank, "nonfinite" or "error", its message) of the first rank that sent :func:`payload`,
    or None. Only a small payload holding the marker is parsed; a small torch payload is read on
    the host (:func:`on_host`)."""
    for rank, data in enumerate(payloads):
        if len(data) > 1024:
            continue
        data = on_host(data)
        if FAILED[:12] in bytes(data[:64]):
            text = agreement.unwrap_bytes(data)
            if text.startswith(FAILED):
                kind, _, message = text[len(FAILED):].decode("utf-8", "replace").partition("\n")
                return rank, kind, message
    return None


def raise_if_failed(payloads: Sequence, label: str, step: int) -> None:
    """Raise on this rank what a peer's :func:`payload` among ``payloads`` reports: a
    NonFiniteGradientError for a non-finite gradient, else a CommunicationError."""
    failed = failed_rank(payloads)
    if failed is not None:
        error = NonFiniteGradientError if failed[1] == "nonfinite" else CommunicationError
        raise error(f"{label} at step {step}: rank {failed[0]} could not encode its gradient "
                    f"({failed[2]}); every rank skips this step")


def everywhere(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised by every rank at the same collective (a header check every rank
    made on the same gathered headers): no failure payload follows it, since no peer waits for one."""
    exc.deepreduce_every_rank = True
    return exc


def on_every_rank(exc: BaseException) -> bool:
    """Whether :func:`everywhere` marked ``exc``."""
    return bool(getattr(exc, "deepreduce_every_rank", False))
