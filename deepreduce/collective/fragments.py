"""The schedule of semi-synchronous training (DiLoCo, Streaming DiLoCo; spec: ALGORITHMS.md IV.1-2).

Framework-free, so the torch binding (:mod:`deepreduce.torch.diloco`) and its tests share one
definition:

* :func:`split`: the parameters cut into ``P`` fragments, contiguous in module order and of
  roughly equal size (each fragment's end is the first parameter boundary at or past its share
  ``(p + 1) / P`` of the elements, so no fragment is empty);
* :class:`Schedule`: fragment ``p`` synchronises after inner step ``t`` (counted from 1) when
  ``t >= offset_p``, ``t > 0`` and ``(t - offset_p) mod H == 0``, with the staggered offsets
  ``offset_p = p * H // P`` (Streaming DiLoCo's strided pattern: the link carries one fragment at a
  time); its reduction, submitted then, is applied ``delay`` inner steps later. ``delay`` may be at
  most the smallest gap between two fragments' syncs, so at most one fragment is in flight and
  the step engine's one pending step is that fragment's.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from ..errors import ConfigError
from ..params import Param

SYNC_EVERY = Param(int, low=1, high=1 << 40, doc="inner steps between two syncs of a fragment")
FRAGMENTS = Param(int, low=1, high=1 << 20, doc="fragments of the model")
DELAY = Param(int, low=0, high=1 << 40, doc="inner steps between a fragment's submit and its apply")
ALPHA = Param(float, low=0.0, high=1.0, doc="weight of the local parameters when a fragment is applied")


def split(sizes: Sequence[int], fragments: int, owner: str = "DiLoCo") -> List[List[int]]:
    """Indices of ``sizes`` (elements per parameter, in module order) cut into ``fragments``
    contiguous, non-empty groups of roughly equal total size."""
    if fragments > len(sizes):
        raise ConfigError(f"{owner}: fragments={fragments} but the model has only {len(sizes)} trainable "
                          "parameter tensor(s); a fragment holds whole tensors")
    total = sum(int(s) for s in sizes)
    groups: List[List[int]] = [[] for _ in range(fragments)]
    done, p = 0, 0
    for i, size in enumerate(sizes):
        left = len(sizes) - i   # tensors still to place, this one included
        # move on when this fragment reached its share, or when the later fragments need every tensor left
        if groups[p] and p + 1 < fragments and (done >= total * (p + 1) / fragments or left == fragments - p - 1):
            p += 1
        groups[p].append(i)
        done += int(size)
    return groups


class Schedule:
    """When each fragment syncs and when its reduction is applied (see the module docstring)."""

    def __init__(self, sync_every, fragments, delay, alpha, owner: str = "DiLoCo") -> None:
        self.sync_every = SYNC_EVERY.check(owner, "sync_every", sync_every, "argument")
        self.fragments = FRAGMENTS.check(owner, "fragments", fragments, "argument")
        self.delay = DELAY.check(owner, "delay", delay, "argument")
        self.alpha = ALPHA.check(owner, "alpha", alpha, "argument")
        if self.fragments > self.sync_every:
            raise ConfigError(f"{owner}: fragments={self.fragments} exceeds sync_every={self.sync_every}; "
                              "each fragment needs its own sync step within the period")
        self.offsets = [p * self.sync_every // self.fragments for p in range(self.fragments)]
        if self.delay > self.gap:
            raise ConfigError(f"{owner}: delay={self.delay} exceeds {self.gap}, the fewest inner steps between "
                              f"two fragments' syncs (sync_every={self.sync_every}, fragments={self.fragments}); "
                              "a fragment's reduction must be applied before the next one is submitted")

    @property
    def gap(self) -> int:
        """The fewest inner steps between two consecutive syncs (of any fragments)."""
        ends = self.offsets + [self.offsets[0] + self.sync_every]
        return min(b - a for a, b in zip(ends, ends[1:]))

    def syncing(self, step: int) -> Optional[int]:
        """The fragment that syncs after inner step ``step`` (at most one does), or None."""
        if step <= 0:
            return None
        for p, offset in enumerate(self.offsets):
            if step >= offset and (step - offset) % self.sync_every == 0:
                return p
        return None

    def describe(self) -> str:
        """The schedule in words (the ranks compare it before the first outer step)."""
        return (f"sync_every={self.sync_every} fragments={self.fragments} delay={self.delay} "
                f"alpha={self.alpha!r}")

    def as_dict(self) -> dict:
        return {"sync_every": self.sync_every, "fragments": self.fragments, "delay": self.delay,
                "alpha": self.alpha}
