"""The sparse all-reduce as a route: per-rank bytes flat in the number of ranks
(:class:`deepreduce.collective.sparse_allreduce.SparseAllreduce` holds the algorithm, its owner
residuals and shard bounds).

Phase one's select and encode (a container per shard) run on the engine's worker as each
gradient arrives, while backward goes on. An item of at least ``early_numel`` elements (the
aggregation's setting: a large tensor, or a DDP bucket) then starts its own alltoall there and
then, so its shard exchange travels during the rest of backward. After backward
(:meth:`SparseAllreduceRoute.settle_all`, in the canonical order, the same on every rank) each
early item's owner step runs and starts its collective returning the shards; the smaller items
share one collective per phase: one alltoall carries every tensor's shard containers to their
owners, each owner's steps run tensor by tensor, one more collective returns every shard to every
rank. Then each item's tensors are decoded. Which items go early depends on their sizes only, so
every rank sends the same batches; they start in submission order, as the allgather route's
collectives do. A rank that failed to encode a
tensor sends that tensor's failure payload inside the batch, so every rank raises (or skips)
together and stays in phase.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from ._base import Outcome, Route


@dataclass
class Share:
    """An item's place in the step's batch: the batch (None until :meth:`SparseAllreduceRoute.settle_all`
    sent it), the indexes of the item's parts in it, and the batch's error where it failed as a whole."""

    phases: list
    batch: object = None
    indexes: Optional[List[int]] = None
    error: Optional[BaseException] = None

    @property
    def early(self) -> bool:
        """Its exchange started while backward went on (a batch of its own)."""
        return self.batch is not None and self.indexes is None


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
        return self._share(engine, item, phases)

    def fail(self, engine, item, error):
        if item.header is not None:   # start raised before its header went: the peers wait for it
            engine.gather(item, None).wait()
        return self._share(engine, item, [self.reducer.encode_failed(name, item.step, engine.tensors.numel(tensor), error)
                                          for name, tensor, _ in sorted(item.parts, key=lambda part: part[0])])

    def _share(self, engine, item, phases) -> Share:
        """The item's share of the step; an item of ``early_numel`` elements or more sends its
        phase one now, as a batch of its own (its size alone decides: the same on every rank)."""
        share = Share(phases)
        if engine.tensors.numel(item.grad) >= self.reducer.early_numel:
            share.batch = self.reducer.send(phases)
        return share

    def settle_all(self, engine, items) -> None:
        """The step's shard exchanges (``items`` in the canonical order): the early items' owner
        steps, each starting its collective returning the shards; then one alltoall for every part
        of every other item, their owner steps, and the start of one collective returning their
        shards. An error of a batch as a whole is kept for each of its items' :meth:`finish`."""
        shares = [item.started for item in items]
        for share in shares:   # the early items' owner steps, in the canonical order
            if share.early:
                try:
                    self.reducer.exchange(share.batch)
                except Exception as exc:   # noqa: BLE001 (its finish reports it)
                    share.error = exc
                share.indexes = list(range(len(share.phases)))
        shares = [share for share in shares if share.indexes is None]
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
                total = self.reducer.decode(share.batch, index, shards, found, out=engine.tensors.host(target),
                                            divisor=divisor)
                engine.tensors.write(target, total)
        name, found = next(((name, found) for name, _, _, _, found in arrived if found is not None), ("", None))
        return Outcome(write, found, name)
