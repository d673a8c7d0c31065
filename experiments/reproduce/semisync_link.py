"""One rank of the time phase of ``deepreduce reproduce semisync``: messages timed over the link.

Started by :mod:`experiments.reproduce.semisync` in the network namespaces of a
:class:`~experiments.reproduce.netns.ShapedLink` (or over loopback), one process per rank, joined by
gloo. ``--messages`` is a JSON list of ``[op, bytes]``: one collective of the kind a training run
recorded (:mod:`experiments.reproduce.comm_record`) with that many bytes handed in by each rank.
Each is replayed ``--repeats`` times: a barrier, then the collective on a buffer of that size,
timed on each rank until it returns; the time of a repeat is the slowest rank's, the message's
time the median over repeats. Rank 0 writes ``[[op, bytes, seconds], ...]`` to ``--out``.

Replays: ``all_reduce`` on float32 (bytes / 4 elements; the fp16 hook's bytes take as long),
``all_gather`` and ``all_gather_into_tensor`` of uint8, ``all_to_all_single`` with the bytes
split evenly over the other ranks (a rank's recorded bytes are what it sends to the others; the
sparse all-reduce's rounds send about as much to each), ``broadcast`` from rank 0,
``reduce_scatter_tensor`` as an all-reduce of its input (gloo has no reduce-scatter; an upper
bound). ``all_gather_single`` and ``reduce_scatter_single`` (FSDP2's names) replay as their
``_tensor`` twins.

``--groups`` (JSON list of rank lists that partition the ranks): each rank replays every message
inside its own group, all groups at once. :mod:`~experiments.reproduce.hsdp` uses it for HSDP's
replicate groups (ranks [0, 2] and [1, 3] of two "nodes" of two ranks), which share the link
between the nodes as they do in training.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from typing import List, Optional

from .common import leave


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="one rank of the semisync time phase")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--messages", required=True, help="JSON list of [op, bytes per rank]")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--groups", default=None, help="JSON list of rank lists; each rank replays in its own group")
    return p.parse_args(argv)


def replay(op: str, nbytes: int, rank: int, world: int, group=None) -> None:
    """One collective of kind ``op`` carrying ``nbytes`` from each rank (of ``group``: then
    ``rank`` and ``world`` are the rank's place in it and its size)."""
    import torch
    import torch.distributed as dist

    if op in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single"):
        dist.all_reduce(torch.zeros(max(1, -(-nbytes // 4)), dtype=torch.float32), group=group)
    elif op == "all_gather":
        local = torch.zeros(max(1, nbytes), dtype=torch.uint8)
        dist.all_gather([torch.empty_like(local) for _ in range(world)], local, group=group)
    elif op in ("all_gather_into_tensor", "all_gather_single"):
        local = torch.zeros(max(1, nbytes), dtype=torch.uint8)
        dist.all_gather_into_tensor(torch.empty(world * local.numel(), dtype=torch.uint8), local, group=group)
    elif op == "all_to_all_single":
        part = -(-nbytes // max(1, world - 1))
        splits = [0 if r == rank else part for r in range(world)]
        send = torch.zeros(sum(splits), dtype=torch.uint8)
        dist.all_to_all_single(torch.empty(sum(splits), dtype=torch.uint8), send,
                               output_split_sizes=splits, input_split_sizes=splits, group=group)
    elif op == "broadcast":
        src = 0 if group is None else dist.get_process_group_ranks(group)[0]
        dist.broadcast(torch.zeros(max(1, nbytes), dtype=torch.uint8), src=src, group=group)
    else:
        raise ValueError(f"semisync_link: no replay for collective {op!r}")


def own_group(groups: Optional[str], rank: int, world: int):
    """``(group, rank in it, its size)``: the group of ``--groups`` holding ``rank`` (every rank
    creates every group, as torch.distributed requires), or the default group."""
    import torch.distributed as dist

    if groups is None:
        return None, rank, world
    parts = [sorted(int(r) for r in g) for g in json.loads(groups)]
    if sorted(r for g in parts for r in g) != list(range(world)):
        raise ValueError(f"semisync_link: --groups {parts} must partition ranks 0..{world - 1}")
    made = [dist.new_group(g) for g in parts]
    mine = next(i for i, g in enumerate(parts) if rank in g)
    return made[mine], parts[mine].index(rank), len(parts[mine])


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    group, rank, world = own_group(args.groups, args.rank, args.world)
    replay("all_reduce", 4, rank, world, group)               # connections up before any timing
    out = []
    for op, nbytes in json.loads(args.messages):
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            replay(op, int(nbytes), rank, world, group)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(elapsed.item())
        out.append([op, int(nbytes), statistics.median(times)])
    if args.rank == 0:
        tmp = f"{args.out}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(out, handle)
        os.replace(tmp, args.out)
    dist.barrier()
    return 0


if __name__ == "__main__":
    leave(main())
