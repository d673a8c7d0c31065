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
        return self.reducer.start(engine.tensors.host(item.grad), item.name, item.step)

    def fail(self, engine, item, error):
        return self.reducer.start_failed(item.name, item.step, engine.tensors.numel(item.grad), error)

    def settle(self, engine, item, phase):
        self.reducer.exchange(phase)
        return phase

    def finish(self, engine, item, phase):
        total, found = self.reducer.complete(phase)

        def write(divisor: int) -> None:
            if divisor != 1:
                np.divide(total, divisor, out=total)
            engine.tensors.write(item.target, total)
        return Outcome(write, found)
