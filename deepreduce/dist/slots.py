"""One collective per bucket: fixed-size slots whose prefix is the bucket's header.

A collective that gathers equal-sized buffers (``torch.distributed.all_gather``, NCCL's
allgather) cannot take containers whose sizes differ per rank without learning the sizes first,
which costs a second collective per bucket. Instead every rank sends one **slot** of a size all
ranks know before the step: a :data:`PREFIX_BYTES` header, then up to ``capacity`` bytes of its
payload. The header carries what the ranks must compare anyway: the payload's size, the digest
of the compressor, the digest of the bucket's layout (:class:`deepreduce.dist.agreement.Layout`)
and the step. Every rank sees every header in the same gather, so every rank takes the same
decisions:

* any digest or step differs: every rank raises the same error (:func:`check`);
* a payload is longer than the slot: every rank gathers the rest in a second collective, and
  the slot grows to the longest payload with :data:`SLACK` to spare (:meth:`Slots.settle`);
* a payload is much shorter than the slot for the whole step: the slot shrinks;
* the longest payload is the same size two steps running (a codec whose output size is fixed by
  the tensor's size: QSGD or raw values of every entry, Top-r with raw indices): the slot fits it
  exactly, since slack there would be padding sent every step (12.5% of the bytes).

In steady state a bucket costs one collective. A slot's capacity is keyed by the bucket's
position in the step (the same on every rank, whatever the ranks disagree about), starts at 0
(the first step of a bucket pays the second collective) and is process-local: every rank starts
from 0 in a new process, so the capacities stay equal.
"""
from __future__ import annotations

from typing import Callable, Dict, Hashable, Optional

import numpy as np

from ..errors import CommunicationError
from . import agreement

FIELDS = ("size", "compressor", "layout", "step")
PREFIX_BYTES = 8 * len(FIELDS)   # little-endian int64 each
FAILED = -1          # the size a rank reports when its encode raised and it has no payload to say so
SLACK = 1 / 8        # a grown slot holds the longest payload seen plus this fraction
SHRINK_BELOW = 1 / 4  # a slot whose longest payload used less than this fraction of it shrinks
ALIGN = 64


def prefix(size: int, layout: agreement.Layout, step: int) -> np.ndarray:
    """A rank's header as :data:`PREFIX_BYTES` uint8."""
    return np.array([size, layout.compressor_digest, layout.digest, step], dtype="<i8").view(np.uint8)


def parse(prefixes: np.ndarray) -> np.ndarray:
    """Every rank's header (``(ranks, PREFIX_BYTES)`` uint8) as ``(ranks, 4)`` int64, fields as :data:`FIELDS`."""
    return np.ascontiguousarray(prefixes, dtype=np.uint8).view("<i8").reshape(-1, len(FIELDS))


def _aligned(nbytes: float) -> int:
    return int(-(-int(np.ceil(nbytes)) // ALIGN) * ALIGN)


class Slots:
    """The slot capacity of every bucket position; equal on every rank because each update is
    a function of headers every rank gathered."""

    def __init__(self) -> None:
        self._capacity: Dict[Hashable, int] = {}
        self._longest: Dict[Hashable, int] = {}   # the previous step's longest payload per position

    def capacity(self, key: Hashable) -> int:
        """Bytes of payload the slot of bucket position ``key`` carries this step."""
        return self._capacity.get(key, 0)

    def settle(self, key: Hashable, sizes: np.ndarray) -> int:
        """After the gather of ``key``'s slots, given every rank's payload size: the bytes of the
        longest payload that did not fit (0: no second collective), and the capacity for the next
        step (grown on overflow, shrunk when the slot is far too large, exact when the longest
        payload kept its size since the previous step)."""
        capacity, longest = self.capacity(key), int(np.max(sizes, initial=0))
        steady = self._longest.get(key) == longest
        self._longest[key] = longest
        if longest > capacity or longest < SHRINK_BELOW * capacity:
            self._capacity[key] = _aligned(longest * (1 + SLACK))
        elif steady:
            self._capacity[key] = _aligned(longest)
        return max(0, longest - capacity)


def check(headers: np.ndarray, where: str, explain: Callable[[], str]) -> None:
    """The same CommunicationError on every rank when the ranks' compressors or layouts differ
    (``explain()``, a collective every rank enters, names the first difference)."""
    if len(set(headers[:, 1].tolist())) > 1 or len(set(headers[:, 2].tolist())) > 1:
        raise CommunicationError(f"{where}: {explain()}; every rank must run the same model with the same "
                                 "deepreduce config")


def check_step(headers: np.ndarray, where: str, equal_sizes: Optional[str] = None) -> None:
    """The same CommunicationError on every rank when a rank reported :data:`FAILED`, when the
    ranks' step counters differ, or, with ``equal_sizes`` (a compressor's name), when their codes
    for one all-reduce differ in size."""
    failed = [rank for rank, size in enumerate(headers[:, 0].tolist()) if size == FAILED]
    if failed:
        raise CommunicationError(f"{where}: rank(s) {failed} could not encode their gradients (their own error "
                                 "says why)")
    if len(set(headers[:, 3].tolist())) > 1:
        raise CommunicationError(f"{where}: ranks disagree about the step counter ({headers[:, 3].tolist()}); "
                                 "every rank must resume from the same checkpoint")
    if equal_sizes is not None and len(set(headers[:, 0].tolist())) > 1:
        raise CommunicationError(f"{where}: ranks produced codes of different sizes ({headers[:, 0].tolist()} "
                                 f"bytes) for an all_reduce; their {equal_sizes} states differ")
