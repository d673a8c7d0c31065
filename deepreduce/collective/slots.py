"""One collective per bucket: fixed-size slots whose prefix is the bucket's header.

A collective that gathers equal-sized buffers (``torch.distributed.all_gather``, NCCL's
allgather) cannot take containers whose sizes differ per rank without learning the sizes first,
which costs a second collective per bucket. Instead every rank sends one **slot** of a size all
ranks know before the step: a :data:`PREFIX_BYTES` header, then up to ``capacity`` bytes of its
payload. The header carries what the ranks must compare anyway: the payload's size, the digest
of the compressor, the digest of the bucket's layout (:class:`deepreduce.collective.agreement.Layout`)
and the step. Every rank sees every header in the same gather, so every rank takes the same
decisions:

* any digest or step differs: every rank raises the same error (:func:`check`);
* a payload is longer than the slot: every rank gathers the rest in a second collective, and
  the slot grows to the longest payload with :data:`SLACK` to spare (:meth:`Slots.settle`);
* a payload is much shorter than the slot for the whole step: the slot shrinks;
* the longest payload is the same size two steps running (a codec whose output size is fixed by
  the tensor's size: QSGD or raw values of every entry, Top-r with raw indices): the slot fits it
  exactly, since slack there would be padding sent every step (12.5% of the bytes).

**Summed payloads.** A summable compressor's codes are summed by all-reduce, which carries no
per-rank header. On a bucket position's first step the header travels alone before the
all-reduce; its checks passed, every rank records what every rank sent (:meth:`Slots.agree`: the
codes' layout, size and dtype, and the step). From then on one all-reduce carries the codes and
one element more, each rank's :meth:`Slots.flag`: 0 when it sends what was agreed, one step
later; else 1, with zeros for codes (its encode raised, the bucket was rebuilt, its codes changed
size, a checkpoint moved its step counter). A sum of 0: every rank matched, one collective did
it. Else every rank saw it, and every rank exchanges headers, whose checks raise the error the
difference calls for on every rank, and all-reduces the codes again.

In steady state a bucket costs one collective. A slot's capacity is keyed by the bucket's
position in the step (the same on every rank, whatever the ranks disagree about), starts at 0
(the first step of a bucket pays the second collective) and is process-local: every rank starts
from 0 in a new process, so the capacities stay equal. :meth:`Slots.exchange` runs the exchange
on NumPy arrays or on torch tensors on any device (:mod:`deepreduce.backend.arrays`); the
adapter passes its allgather.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Optional, Tuple

import array_api_compat
import numpy as np

from ..backend import arrays
from ..errors import CommunicationError
from . import agreement

FIELDS = ("size", "compressor", "layout", "step")
PREFIX_BYTES = 8 * len(FIELDS)   # little-endian int64 each
FAILED = -1          # the size a rank reports when its encode raised and it has no payload to say so
SLACK = 1 / 8        # a grown slot holds the longest payload seen plus this fraction
SHRINK_BELOW = 1 / 4  # a slot whose longest payload used less than this fraction of it shrinks
ALIGN = 64


@dataclass(frozen=True)
class Header:
    """What a bucket's collective checks (the transport :mod:`deepreduce.collective.comm.torch_slots`):
    ``key``, the bucket's position in the step (its slot); ``layout``, its tensors and the
    compressor; ``step``; ``where``, the bucket in errors; ``dense_bytes``, its float32 size (the
    totals); ``summed``: for a summable compressor's codes, its name (their sizes must agree);
    ``device``: where the bucket lives (its collective runs there), None: the transport's default."""

    key: Hashable
    layout: agreement.Layout
    step: int
    where: str
    dense_bytes: int
    summed: Optional[str] = None
    device: object = None


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
        self._agreed: Dict[Hashable, tuple] = {}   # summed payloads: (signature, step) every rank checked

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

    def agreed(self, key: Hashable) -> Optional[tuple]:
        """The signature of ``key``'s summed payloads that every rank checked last (:meth:`agree`),
        or None: the header travels before the all-reduce."""
        return self._agreed.get(key, (None,))[0]

    def flag(self, key: Hashable, signature: Optional[tuple], step: int) -> int:
        """This rank's flag in ``key``'s steady all-reduce: 0 when it sends ``signature`` (None:
        nothing, its encode raised) at the step after the agreed one, else 1."""
        return int(signature is None or self._agreed.get(key) != (signature, step - 1))

    def agree(self, key: Hashable, signature: tuple, step: int) -> None:
        """Every rank reduced ``key`` at ``step`` with ``signature`` (its header checks passed, or
        no rank flagged)."""
        self._agreed[key] = (signature, step)

    def exchange(self, key: Hashable, header: np.ndarray, payload, gather: Callable[[object], List], like,
                 where: str, explain: Callable[[], str]) -> Tuple[np.ndarray, Optional[List]]:
        """One bucket position's exchange: this rank's ``header`` (:func:`prefix`) and ``payload``
        (a 1-D uint8 array of ``like``'s framework, on its device; None: the header alone) in a
        slot of :meth:`capacity` bytes through ``gather`` (an allgather of equal-sized arrays,
        every rank's in rank order). Every rank checks every header first (:func:`check`, with
        ``where`` and ``explain``); what outgrew the slot comes in a second ``gather``
        (:meth:`settle`). Returns (every rank's header as :func:`parse` gives them, every rank's
        payload or None)."""
        xp, adapter = arrays.namespace(like), arrays.adapter(like)
        device = array_api_compat.device(like)
        capacity = 0 if payload is None else self.capacity(key)
        size = 0 if payload is None else payload.shape[0]
        slot = xp.zeros(PREFIX_BYTES + capacity, dtype=xp.uint8, device=device)
        slot[:PREFIX_BYTES] = adapter.from_numpy(header, like)
        if payload is not None:
            slot[PREFIX_BYTES:PREFIX_BYTES + min(size, capacity)] = payload[:capacity]
        gathered = gather(slot)
        headers = parse(adapter.to_numpy(xp.stack([g[:PREFIX_BYTES] for g in gathered])))
        check(headers, where, explain)
        if payload is None:
            return headers, None
        sizes = [int(n) for n in headers[:, 0]]
        parts = [g[PREFIX_BYTES:PREFIX_BYTES + min(n, capacity)] for g, n in zip(gathered, sizes)]
        rest = self.settle(key, headers[:, 0])
        if rest:   # a payload outgrew the slot: every rank saw it, every rank gathers the rest
            extra = xp.zeros(rest, dtype=xp.uint8, device=device)
            extra[:max(0, size - capacity)] = payload[capacity:]
            parts = [xp.concat([part, more[:max(0, n - capacity)]]) for part, more, n in zip(parts, gather(extra), sizes)]
        return headers, parts


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
