"""One rank of ``deepreduce bench-scaling --real-engine``: the Horovod optimizer's step (the step
engine, as a training job runs it) per aggregation, in wall and CPU seconds.

Launched by ``horovodrun -np N`` (oversubscribed on one machine: N ranks share its cores). The
toy model of :mod:`experiments.engine_toy` (one parameter per tensor size, a fixed Laplace
gradient per rank and step) runs, and its ``backward()`` + ``synchronize()`` is timed, once with the
allgather of containers and once with the sparse all-reduce, same config. CPU seconds are the
process's (every thread: the engine's worker and Horovod's background thread included), so on
an oversubscribed machine they measure what a rank costs, where wall time measures the queue.
The ranks run with the main job's runtime settings (:mod:`experiments.runtime`, each only where
the environment does not set it): the benchmark measures the step the job runs.
Rank 0 prints one JSON line per aggregation: medians over the steps after the first, the
slowest rank's, and the engine's ``compression_stats()`` split; with ``--probe``, before and after
them one line each of what Horovod's collectives alone cost a rank at this N and what the toy
step's compute costs with every rank running it at once (the cost model's collective and compute
terms).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import horovod.torch as hvd
import numpy as np
import torch

import deepreduce
import deepreduce.torch as drt
from deepreduce.collective.comm.horovod import settled
from deepreduce.collective.cost_probe import measure_collective_costs
from experiments import runtime
from experiments.engine_toy import compute_cpu_s, forward_backward, gradients, parameters


def measure(aggregation: str, config: str, numels, steps: int, seed: int) -> dict:
    params = parameters(numels)
    compression = dict(deepreduce.build(config).get_config(), aggregation={"id": aggregation})
    compression.pop("communicator", None)
    opt = drt.DistributedOptimizer(torch.optim.SGD(params.parameters(), lr=0.0),
                                   named_parameters=params.named_parameters(), compression=compression)
    wall, cpu = [], []
    for step in range(steps + 1):
        grads = gradients(numels, hvd.rank(), step, seed)
        opt.zero_grad()
        hvd.allreduce(torch.zeros(1), name=f"barrier.{aggregation}.{step}")   # every rank starts together
        w0, c0 = time.perf_counter(), time.process_time()
        forward_backward(params, grads)
        opt.synchronize()
        w1, c1 = time.perf_counter(), time.process_time()
        with opt.skip_synchronize():
            opt.step()
        if step:   # the first step agrees the layout and warms the caches
            wall.append(w1 - w0)
            cpu.append(c1 - c0)
    stats = opt.compression_stats()
    mine = torch.tensor([float(np.median(wall)), float(np.median(cpu)), stats["encode_seconds"] / (steps + 1),
                         stats["communication_wait_seconds"] / (steps + 1), stats["decode_seconds"] / (steps + 1)],
                        dtype=torch.float64)
    worst = hvd.allreduce(mine, op=hvd.Max, name=f"result.{aggregation}").tolist()
    return {"aggregation": aggregation, "codec": config, "ranks": hvd.size(), "numels": list(numels),
            "wall_s": worst[0], "cpu_s": worst[1], "encode_s": worst[2], "communication_s": worst[3],
            "decode_s": worst[4], "runtime": {key: os.environ.get(key) for key in runtime.DEFAULTS}}


def allgather(payload: np.ndarray, name: str):
    """Horovod's allgather of a uint8 NumPy payload, waited for as the engine's transport waits
    (``settled``: polling, not Horovod's spinning ``synchronize``)."""
    return settled(hvd, hvd.allgather_async(torch.from_numpy(payload), name=name))


def alltoall(payloads, name: str):
    """Horovod's alltoall of uint8 NumPy payloads, one per rank, waited for as ``allgather``."""
    sizes = torch.tensor([p.size for p in payloads], dtype=torch.int32)
    return settled(hvd, hvd.alltoall_async(torch.from_numpy(np.concatenate(payloads)), splits=sizes, name=name))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="topk_raw")
    parser.add_argument("--numels", default="2359296,1048576,262144")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe", action="store_true", help="before and after the steps, time Horovod's collectives "
                        "alone at this N (deepreduce.collective.cost_probe.measure_collective_costs) and the toy "
                        "compute on every rank at once, and print them")
    args = parser.parse_args()
    runtime.apply_defaults()   # before hvd.init(), which starts MPI
    hvd.init()
    torch.set_num_threads(1)
    numels = [int(n) for n in args.numels.split(",")]
    if args.probe:   # the transport alone and the compute at this N, before the steps: the cost model's terms
        probe(numels, args.seed)
    for aggregation in ("allgather", "sparse_allreduce"):
        row = measure(aggregation, args.config, numels, args.steps, args.seed)
        if hvd.rank() == 0:
            print("ENGINE " + json.dumps(row), flush=True)
    if args.probe:   # and after them, so that a load that changed meanwhile shows in the mean of the two
        probe(numels, args.seed)


def barrier() -> None:
    hvd.allreduce(torch.zeros(1), name="probe.barrier")


def probe(numels, seed: int) -> None:
    """Time Horovod's collectives alone at this N, and the toy step's compute with every rank
    running it at once (``compute_s``, the slowest rank's median CPU seconds); rank 0 prints them as
    one ``COLLECTIVE {...}`` line."""
    found = measure_collective_costs(allgather, alltoall, hvd.rank(), hvd.size())
    mine = compute_cpu_s(numels, steps=5, seed=seed, rank=hvd.rank(), before=barrier)
    found["compute_s"] = float(hvd.allreduce(torch.tensor([mine], dtype=torch.float64), op=hvd.Max,
                                             name="probe.compute")[0])
    if hvd.rank() == 0:
        print("COLLECTIVE " + json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
