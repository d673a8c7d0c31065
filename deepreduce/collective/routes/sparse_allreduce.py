"""The sparse all-reduce as a route: per-rank bytes flat in the number of ranks
(:class:`deepreduce.collective.sparse_allreduce.SparseAllreduce` holds the algorithm, its owner
residuals and shard bounds). Phase one (select, encode a container per shard, start the alltoall)
runs on the engine's worker as the gradient arrives; the owner step and the allgather's start
run for every tensor in name order after backward, then every allgather is waited for and decoded."""
from __future__ import annotations

import numpy as np

from ._base import Outcome, Route


class SparseAllreduceRoute(Route):
    id = "sparse_allreduce"
    ORDER = 1   # after the routes whose collectives Horovod matches by name

    def __init__(self, engine) -> None:
        self.engine = engine

    @property
    def reducer(self):
        reducer = self.engine.protocol.sparse
        reducer.asynchronous = True   # phase one starts on the worker, while backward goes on
        return reducer

    def start(self, engine, item):
        """Phase one of every part, in name order (a transport with headers first checks the
        item's alone). A part whose encode raises sends the failure payload in its place, and
        the item's other parts go on, so every rank issues the same collectives."""
        if item.header is not None:
            engine.gather(item, None).wait()
        phases = []
        for name, tensor, _ in sorted(item.parts, key=lambda part: part[0]):
            try:
                phases.append(self.reducer.start(engine.tensors.host(tensor), name, item.step))
            except Exception as exc:   # noqa: BLE001 (raised at finish; the peers hear of it)
                engine.caught(item, exc)
                phases.append(self.reducer.start_failed(name, item.step, engine.tensors.numel(tensor), exc))
        return phases

    def fail(self, engine, item, error):
        if item.header is not None:   # start raised before its header went: the peers wait for it
            engine.gather(item, None).wait()
        return [self.reducer.start_failed(name, item.step, engine.tensors.numel(tensor), error)
                for name, tensor, _ in sorted(item.parts, key=lambda part: part[0])]

    def settle(self, engine, item, phases):
        for phase in phases:
            self.reducer.exchange(phase)
        return phases

    def finish(self, engine, item, phases):
        targets, done, error = {name: out for name, _, out in item.parts}, [], None
        for phase in phases:   # every part's allgather is waited for, then the first error raised
            try:
                done.append((phase.name, targets[phase.name], *self.reducer.complete(phase)))
            except Exception as exc:   # noqa: BLE001
                error = error or exc
        if error is not None:
            raise error

        def write(divisor: int) -> None:
            for _, target, total, _ in done:
                if divisor != 1:
                    np.divide(total, divisor, out=total)
                engine.tensors.write(target, total)
        name, found = next(((name, found) for name, _, _, found in done if found is not None), ("", None))
        return Outcome(write, found, name)
