"""A sparse gradient (torch sparse COO, TF ``IndexedSlices``) sent as its touched entries in one
container (:func:`encode_entries`), allgathered, and summed without a dense tensor
(:func:`decode_entries`). The two are this route's encode and decode, written on the pipeline's
stages; the TensorFlow binding's sparse path calls them too."""
from __future__ import annotations

import math
import time
from typing import Sequence

import numpy as np

from ...errors import DeepReduceError
from ...pipeline import Pipeline, all_finite, dense_container, select_positions
from .. import agreement, failure
from ._base import Outcome, Route


def encode_entries(core: Pipeline, positions, values, shape: Sequence[int], name: str = "",
                   step: int = 0) -> np.ndarray:
    """Compress a gradient given by its touched entries: ascending distinct flat ``positions``
    into a tensor of ``shape`` and their float32 ``values``. The positions go straight to the
    index codec and the values to the value codec; no dense tensor is made (Bloom policies other
    than ``naive`` read values at their false positives, so they get a dense copy). Sparsifier
    ``none`` sends every touched entry, zeros included, so the receivers see the rows the sender
    touched; another sparsifier selects among the touched values. With error feedback
    (``memory: residual``) the residual stays sparse too (``ResidualMemory.accumulate_entries``):
    the touched entries are compensated by it, and it keeps what was not sent. A warm-up step
    (``Pipeline.warming_up``) sends the tensor dense, as a non-finite or small one.
    """
    start = time.perf_counter()
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    values = np.ascontiguousarray(values, dtype=np.float32)
    shape, numel = tuple(int(n) for n in shape), math.prod(int(n) for n in shape)
    if positions.shape != values.shape or positions.ndim != 1:
        raise DeepReduceError(f"encode_entries {name!r}: {positions.shape[0]} positions, {values.shape} values")
    core.save_state(name)
    if not all_finite(values) or numel < core.min_numel or core.warming_up(step):   # the dense path
        dense = np.zeros(numel, dtype=np.float32)
        dense[positions] = values
        return core.encode(dense.reshape(shape), name=name, step=step)
    ctx = core.context(name, step)
    touched = None
    if core.memory.stateful:   # compensated entries: the gradient's and the residual's
        touched = positions, values = core.memory.accumulate_entries(name, positions, values, numel)
        if not all_finite(values):
            return _overflowed(core, touched, shape, name, step, start)
    if core.sparsifier.id != "none":
        keep = select_positions(core.sparsifier, values, ctx)
        positions, values = positions[keep], values[keep]
    if getattr(core.index, "policy", "naive") == "naive":
        lookup = np.broadcast_to(np.float32(0), (numel,))   # shape and namespace only: no memory
    else:
        lookup = np.zeros(numel, dtype=np.float32)
        lookup[positions] = values
    c, sent, received = core.pack_selection(lookup, positions, ctx, shape, values=values)
    if touched is not None:
        core.memory.settle_entries(name, *touched, sent, received, numel)
    return core.pack([c], start)[0]


def _overflowed(core: Pipeline, touched, shape, name: str, step: int, start: float) -> np.ndarray:
    """Compensated entries that overflow float32 travel dense and flagged, and the residual starts
    again from nothing (a skipped step restores it); refused under ``raise`` outside a collective step."""
    core.refuse_overflow(name, step)
    numel = math.prod(shape)
    dense = np.zeros(numel, dtype=np.float32)
    dense[touched[0]] = touched[1]
    c = dense_container(dense, shape, nonfinite=True)
    core.memory.settle_entries(name, *touched, None, None, numel)
    return core.pack([c], start)[0]


def decode_entries(core: Pipeline, payloads: Sequence, expected_shape: Sequence[int]):
    """The sum of several containers (one per rank) as (ascending distinct flat positions,
    float32 sums there), without a dense tensor: what :func:`encode_entries` senders need.
    Ranks' entries at one position are added in rank order."""
    positions, values = [], []
    for rank, payload in enumerate(payloads):
        try:
            idx, val = core.entries_of(payload, expected_shape)
        except DeepReduceError as exc:
            raise type(exc)(f"rank {rank}: {exc}") from exc
        positions.append(idx)
        values.append(val)
    return sum_entries(np.concatenate(positions), np.concatenate(values))


def sum_entries(positions: np.ndarray, values: np.ndarray):
    """(distinct ascending positions, the sum of the values at each), adding in the given order."""
    order = np.argsort(positions, kind="stable")
    positions, values = positions[order], values[order]
    if positions.shape[0] == 0:
        return positions, values
    starts = np.flatnonzero(np.r_[True, positions[1:] != positions[:-1]])
    return positions[starts], np.add.reduceat(values, starts).astype(np.float32, copy=False)


class Entries(Route):
    id = "entries"
    ORDER = 0

    def __init__(self, engine) -> None:
        self.engine = engine

    def start(self, engine, item):
        positions, values = engine.tensors.entries(item.grad)
        payload = encode_entries(engine.core, positions, values, tuple(engine.tensors.shape(item.grad)),
                                 name=item.name, step=item.step)
        return engine.gather(item, payload)

    def fail(self, engine, item, error):
        return engine.gather(item, failure.payload(error))

    def finish(self, engine, item, pending):
        payloads = [failure.on_host(p) for p in pending.wait()]   # the core decodes host bytes
        failure.raise_if_failed(payloads, item.label, item.step)

        def write(divisor: int) -> None:
            try:
                positions, values = decode_entries(engine.core, payloads, tuple(engine.tensors.shape(item.target)))
            except DeepReduceError as exc:
                raise type(exc)(f"{item.label}: {exc}") from exc
            if divisor != 1:
                np.divide(values, divisor, out=values)
            item.replace(engine.tensors.from_entries(positions, values, like=item.target))
        return Outcome(write, agreement.first_nonfinite(payloads))
