"""One rank of ``deepreduce bench-scaling --real``: bytes and decode work per step, per aggregation.

Launched by ``mpirun --oversubscribe -np N`` (mpi4py communicator). Every rank reduces the same
list of tensor sizes for a few steps, once by the allgather of whole containers and once by the
sparse all-reduce, with one config; rank 0 prints one JSON line per aggregation with what one
rank received per step (all of the collectives' outputs, the rank's own part included; and from
the other ranks only, in bytes and in entries) and its decode seconds per step (the median rank's).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import deepreduce
from deepreduce.collective.comm.mpi import MPICommunicator
from deepreduce.collective.sparse_allreduce import SparseAllreduce


def gradient(numel: int, rank: int, step: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, rank, step, numel]).laplace(size=numel).astype(np.float32)


class Counting:
    """The communicator, counting what each collective hands back to this rank."""

    def __init__(self, comm: MPICommunicator) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.total = self.others = self.entries = 0

    def _count(self, parts):
        for j, part in enumerate(parts):
            self.total += int(part.shape[0])
            if j != self.rank:
                self.others += int(part.shape[0])
                self.entries += deepreduce.inspect(part)["n"]
        return parts

    def allgather(self, payload, name):
        return self._count(self.comm.allgather(payload, name))

    def alltoall(self, payloads, name):
        return self._count(self.comm.alltoall(payloads, name))


def measure(aggregation: str, config: str, numels, steps: int, seed: int, comm: MPICommunicator) -> dict:
    pipe = deepreduce.build(config)
    counting = Counting(comm)
    sparse = SparseAllreduce(pipe, counting) if aggregation == "sparse_allreduce" else None
    decode_s, wall_s = [], []
    for step in range(steps):
        counting.total = counting.others = counting.entries = 0
        before, start = pipe.stats.decode_seconds, time.perf_counter()
        for i, numel in enumerate(numels):
            g = gradient(numel, comm.rank, step, seed)
            if sparse is not None:
                sparse.reduce(g, f"t{i}", step)
            else:
                pipe.decode_sum(counting.allgather(pipe.encode(g, name=f"t{i}", step=step), f"t{i}"),
                                expected_shape=(numel,))
        decode_s.append(pipe.stats.decode_seconds - before)
        wall_s.append(time.perf_counter() - start)
    per_rank = comm._comm.gather((counting.total, counting.others, counting.entries,
                                  float(np.median(decode_s)), float(np.median(wall_s))), root=0)
    if comm.rank != 0:
        return {}
    totals, others, entries, decodes, walls = zip(*per_rank)
    k = sum(max(1, int(0.01 * n)) for n in numels)
    return {"aggregation": aggregation, "codec": config, "ranks": comm.size, "numels": list(numels),
            "k": k, "received_total_bytes": max(totals), "received_bytes": max(others),
            "entries_from_others": max(entries), "decode_s": float(np.median(decodes)),
            "step_s": float(np.median(walls))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="topk_raw")
    parser.add_argument("--numels", default="2359296,1048576,262144")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    comm = MPICommunicator()
    numels = [int(n) for n in args.numels.split(",")]
    for aggregation in ("allgather", "sparse_allreduce"):
        row = measure(aggregation, args.config, numels, args.steps, args.seed, comm)
        if row:
            print("RUN " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
