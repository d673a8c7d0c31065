"""One rank of the Fig. 11 measurement: NCF training iterations timed as compute / codec / network.

Started by :mod:`experiments.reproduce.fig11` inside a network namespace (``ip netns exec``),
one process per rank, joined by torch.distributed (gloo over TCP on the namespaces' private
veth link). For each method in turn it rebuilds the same seeded model and runs ``warmup`` then
``iterations`` training iterations; per iteration it times

* ``compute``: forward and backward of the local mini-batch (of ``accumulate`` micro-batches,
  whose gradients add up before one exchange, as in the paper's gradient accumulation);
* ``codec``: DeepReduce encode of every gradient plus decode-and-sum of every rank's container
  straight into the parameter's ``.grad`` (zero for the dense baseline);
* ``comm``: the collectives: dense ``all_reduce`` of one flat buffer for the baseline, one
  ``torch_distributed`` communicator allgather of this rank's fused containers (all tensors in
  one buffer) for compressed methods; a barrier before it keeps the ranks' different encode
  times out of the communication figure;

then applies the averaged gradient with Adam. PyTorch's own compression (methods
``{"ddp_hook": ...}``: PowerSGD, fp16) runs as PyTorch users run it, a DDP communication hook
on a ``DistributedDataParallel`` model (gradient accumulation under ``no_sync()``); its hook
time splits into codec and collective waits (:class:`~experiments.reproduce.torch_hooks.HookTimer`)
and compute is the rest of forward and backward. Rank 0 writes one JSON file with the per-method
medians, bytes sent per iteration and the final training loss.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import time
from typing import List, Optional

import numpy as np

from .common import leave

DENSE = "allreduce"


def fuse(payloads: List[np.ndarray]) -> np.ndarray:
    """All of one rank's containers in one buffer: their lengths (uint64) then their bytes.

    One allgather per iteration instead of one per tensor, like Horovod's tensor fusion (the
    dense baseline likewise all-reduces one flat buffer)."""
    lengths = np.array([p.size for p in payloads], dtype="<u8")
    return np.concatenate([lengths.view(np.uint8)] + [np.asarray(p, dtype=np.uint8) for p in payloads])


def unfuse(buffer: np.ndarray, count: int) -> List[np.ndarray]:
    """Split a fused buffer of ``count`` containers (inverse of :func:`fuse`)."""
    head = 8 * count
    lengths = np.frombuffer(buffer[:head].tobytes(), dtype="<u8").astype(np.int64)
    if buffer.size != head + int(lengths.sum()):
        raise ValueError(f"fused buffer has {buffer.size} bytes, its header announces {head + int(lengths.sum())}")
    ends = head + np.cumsum(lengths)
    return [buffer[e - n:e] for n, e in zip(lengths, ends)]


def _batches(data, batch: int, rank: int, world: int):
    """This rank's mini-batches, epoch after epoch, forever."""
    epoch = 0
    while True:
        yield from data.epoch(epoch, batch, rank=rank, size=world)
        epoch += 1


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="one rank of deepreduce reproduce fig11")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--init", required=True, help="torch.distributed init method, tcp://ADDR:PORT")
    p.add_argument("--methods", required=True, help="JSON: list of [label, config-or-null]")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny data set")
    p.add_argument("--batch", type=int, default=5120, help="local mini-batch (positives + negatives)")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches whose gradients one iteration sums")
    p.add_argument("--out", default=None, help="rank 0 writes the results here (JSON)")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout in seconds")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel

    from deepreduce.collective.comm.torch_distributed import TorchDistributedCommunicator
    from deepreduce.config import build

    from ..models.ncf import NCF
    from ..recsys_data import QUICK, ZipfConfig, generate
    from . import torch_hooks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    comm = TorchDistributedCommunicator()
    data = generate(QUICK if args.quick else ZipfConfig())
    results = []
    for label, config in json.loads(args.methods):
        torch.manual_seed(0)
        model = NCF(data.n_users, data.n_items)
        opt = torch.optim.Adam(model.parameters(), lr=0.002)
        params = list(model.named_parameters())
        hooked = torch_hooks.is_hook(config)
        pipe = build(config) if config is not None and not hooked else None
        forward, timer, warmup = model, None, args.warmup
        if hooked:
            forward = DistributedDataParallel(model)
            timer = torch_hooks.HookTimer()
            torch_hooks.register(forward, config, timer)
            warmup += torch_hooks.warmup_iterations(config)
        stream = _batches(data, args.batch, args.rank, args.world)
        compute, codec, network, sent, losses = [], [], [], [], []
        dist.barrier()
        for it in range(warmup + args.iterations):
            t0 = time.perf_counter()
            opt.zero_grad()
            if timer is not None:
                timer.reset()
            with timer if timer is not None else contextlib.nullcontext():
                for micro in range(args.accumulate):      # gradients add up over the micro-batches
                    syncing = not hooked or micro == args.accumulate - 1
                    with contextlib.nullcontext() if syncing else forward.no_sync():
                        users, items, labels = next(stream)
                        loss = F.binary_cross_entropy_with_logits(
                            forward(torch.from_numpy(users), torch.from_numpy(items)), torch.from_numpy(labels))
                        (loss / args.accumulate).backward()
            t1 = time.perf_counter()
            enc = dec = comm_s = 0.0
            nbytes = 0
            if hooked:
                enc, dec, comm_s, nbytes = timer.encode_s, timer.decode_s, timer.comm_s, timer.bytes
            elif pipe is None:
                flat = torch.cat([p.grad.reshape(-1) for _, p in params])
                c0 = time.perf_counter()
                dist.all_reduce(flat)
                comm_s = time.perf_counter() - c0
                flat /= args.world
                nbytes = 4 * flat.numel()
                offset = 0
                for _, p in params:
                    n = p.numel()
                    p.grad.copy_(flat[offset:offset + n].view_as(p))
                    offset += n
            else:
                e0 = time.perf_counter()
                payloads = [pipe.encode(p.grad.numpy(), name=name, step=it) for name, p in params]
                fused = fuse(payloads)
                e1 = time.perf_counter()
                dist.barrier()   # ranks finish encoding at different times: keep that out of comm
                e2 = time.perf_counter()
                gathered = [unfuse(part, len(params)) for part in comm.allgather(fused, "fig11")]
                e3 = time.perf_counter()
                for i, (name, p) in enumerate(params):       # every rank's container, summed into .grad
                    pipe.decode_sum([g[i] for g in gathered], tuple(p.shape), out=p.grad.numpy())
                    p.grad.div_(args.world)
                e4 = time.perf_counter()
                enc, comm_s, dec = e1 - e0, e3 - e2, e4 - e3
                nbytes = fused.size
            opt.step()
            if it >= warmup:
                # A hook runs inside backward: there, compute is what the hook's time leaves.
                compute.append(t1 - t0 - (enc + dec + comm_s if hooked else 0.0))
                codec.append(enc + dec)
                network.append(comm_s)
                sent.append(nbytes)
                losses.append(loss.item())
        dense_bytes = 4 * sum(p.numel() for _, p in params)
        # Every rank's figure matters (the slowest rank sets the pace): report the max over ranks.
        stats = torch.tensor([statistics.median(compute), statistics.median(codec), statistics.median(network),
                              float(np.mean(sent))], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        results.append({"method": label, "compute_s": stats[0].item(), "codec_s": stats[1].item(),
                        "comm_s": stats[2].item(), "bytes_per_rank": stats[3].item(),
                        "volume": stats[3].item() / dense_bytes, "dense_bytes": dense_bytes,
                        "final_loss": float(np.mean(losses[-3:]))})
    dist.barrier()
    if args.rank == 0 and args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump({"results": results, "iterations": args.iterations, "warmup": args.warmup,
                       "batch": args.batch, "world": args.world}, handle, indent=2)
    dist.barrier()      # rank 0's file is written before anyone leaves
    return 0


if __name__ == "__main__":
    leave(main())
