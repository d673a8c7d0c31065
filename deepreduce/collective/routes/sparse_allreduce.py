"""The sparse all-reduce as a route: per-rank bytes flat in the number of ranks
(:class:`deepreduce.collective.sparse_allreduce.SparseAllreduce` holds the algorithm, its owner
residuals and shard bounds).

Phase one's select and encode (a container per shard) run on the engine's worker as each
gradient arrives, while backward goes on. After backward, the shard exchanges of every item
of the step on this route share one collective per phase (:meth:`SparseAllreduceRoute.settle_all`,
in the canonical order, the same on every rank): one alltoall carries every tensor's shard
containers to their owners, each owner's steps run tensor by tensor, one more collective returns
every shard to every rank, then each item's tensors are decoded. A rank that failed to encode a
tensor sends that tensor's failure payload inside the batch, so every rank raises (or skips)
together and stays in phase.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from ._base import Outcome, Route


@dataclass
class Share:
    """An item's place in the step's batch: the batch (None until :meth:`SparseAllreduceRoute.settle_all`
    sent it), the indexes of the item's parts in it, and the batch's error where it failed as a whole."""

    phases: list
    batch: object = None
    indexes: Optional[List[int]] = None
    error: Optional[BaseException] = None


class SparseAllreduceRoute(Route):
    id = "sparse_allreduce"
    ORDER = 1   # after the routes whose collectives Horovod matches by name

    def __init__(self, engine) -> None:
        self.engine = engine

    @property
    def reducer(self):
        reducer = self.engine.protocol.sparse
        reducer.asynchronous = True   # a collective starts when it is ready, not when it is waited for
        return reducer

    def start(self, engine, item):
        """Phase one's encode of every part, in name order (a transport with headers first checks
        the item's alone). A part whose encode raises gets the failure payload in its place, and
        the item's other parts go on, so every rank sends the same tensors."""
        if item.header is not None:
            engine.gather(item, None).wait()
        phases = []
        for name, tensor, _ in sorted(item.parts, key=lambda part: part[0]):
            try:
                phases.append(self.reducer.encode(engine.tensors.host(tensor), name, item.step))
            except Exception as exc:   # noqa: BLE001 (raised at finish; the peers hear of it)
                engine.caught(item, exc)
                phases.append(self.reducer.encode_failed(name, item.step, engine.tensors.numel(tensor), exc))
        return Share(phases)

    def fail(self, engine, item, error):
        if item.header is not None:   # start raised before its header went: the peers wait for it
            engine.gather(item, None).wait()
        return Share([self.reducer.encode_failed(name, item.step, engine.tensors.numel(tensor), error)
                      for name, tensor, _ in sorted(item.parts, key=lambda part: part[0])])

    def settle_all(self, engine, items) -> None:
        """The step's shard exchanges (``items`` in the canonical order): one alltoall for every
        part of every item, the owner steps, and the start of one collective returning the shards.
        An error of the batch as a whole is kept for each item's :meth:`finish`."""
        shares = [item.started for item in items]
        phases = [phase for share in shares for phase in share.phases]
        if not phases:
            return
        error, batch = None, None
        try:
            batch = self.reducer.send(phases)
            self.reducer.exchange(batch)
        except Exception as exc:   # noqa: BLE001 (every item of the batch reports it)
            error = exc
        first = 0
        for share in shares:
            share.batch, share.error = batch, error
            share.indexes = list(range(first, first + len(share.phases)))
            first += len(share.phases)

    def finish(self, engine, item, share):
        """Every part's shards arrived and checked (then the first error raised); ``write`` decodes
        them straight into the part's destination where the binding's ``host`` is a view of it
        (a CPU float32 tensor), as the allgather route does, so no step-sized array is made."""
        if share.error is not None:
            raise share.error
        targets, arrived, error = {name: out for name, _, out in item.parts}, [], None
        for index, phase in zip(share.indexes, share.phases):   # every part is read, then the first error raised
            try:
                arrived.append((phase.name, targets[phase.name], index, *self.reducer.arrived(share.batch, index)))
            except Exception as exc:   # noqa: BLE001
                error = error or exc
        if error is not None:
            raise error

        def write(divisor: int) -> None:
            for _, target, index, shards, found in arrived:
                total = self.reducer.decode(share.batch, index, shards, found, out=engine.tensors.host(target))
                if divisor != 1:
                    np.divide(total, divisor, out=total)
                engine.tensors.write(target, total)
        name, found = next(((name, found) for name, _, _, _, found in arrived if found is not None), ("", None))
        return Outcome(write, found, name)
