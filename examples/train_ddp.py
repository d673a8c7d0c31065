"""The main job (ResNet-20 on the digits images) under PyTorch DistributedDataParallel and torchrun.

The model, data, sharding, optimizer settings and per-epoch line are deepreduce/train.py's (the
Horovod job); only the gradient exchange differs: a DDP communication hook.

    torchrun --nproc_per_node 2 examples/train_ddp.py --config configs/bf_p2.yaml   # deepreduce hook
    torchrun --nproc_per_node 2 examples/train_ddp.py --hook powersgd               # PyTorch's PowerSGD (rank 4)
    torchrun --nproc_per_node 2 examples/train_ddp.py --hook fp16                   # PyTorch's fp16 hook
    torchrun --nproc_per_node 2 examples/train_ddp.py --hook none                   # DDP's own allreduce

Across hosts (run on every host; HOST0 is any reachable host):

    torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
        --rdzv-id digits examples/train_ddp.py --config configs/bf_p2.yaml

The other options are deepreduce/train.py's (--epochs, --batch-size, --lr, --max-steps, ...).
Relative volume: deepreduce counts the bytes of its containers, fp16 is 0.5, PowerSGD counts the
elements its low-rank factors (and the tensors it leaves uncompressed) send, none is 1.0.
"""
import argparse
import json
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from deepreduce import train as job
from deepreduce.data import load_digits_32, shard
from deepreduce.models.resnet import ResNet20
from deepreduce.torch import ddp

HOOKS = ("none", "fp16", "powersgd")


def parse_args(argv=None) -> argparse.Namespace:
    """deepreduce/train.py's options plus --hook / --powersgd-rank (--config selects the deepreduce hook)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--hook", choices=HOOKS, default=None,
                        help="one of PyTorch's own hooks instead of deepreduce's (--config)")
    parser.add_argument("--powersgd-rank", type=int, default=4, help="matrix_approximation_rank of --hook powersgd")
    own, rest = parser.parse_known_args(argv)
    args = job.parse_args(rest)
    args.hook, args.powersgd_rank = own.hook, own.powersgd_rank
    return args


class Volume:
    """Bytes (or elements) the hook sent since the last call, over the dense float32 amount."""

    def __init__(self, args, model: DistributedDataParallel) -> None:
        self.numel = sum(p.numel() for p in model.parameters())
        self.state = None
        if args.hook == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif args.hook == "powersgd":
            # start_powerSGD_iter=2: the earliest PyTorch allows with error feedback (deepreduce compresses from step 0)
            self.state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=args.powersgd_rank,
                                                     start_powerSGD_iter=2)
            model.register_comm_hook(self.state, powerSGD_hook.powerSGD_hook)
        elif args.hook is None:
            self.state = ddp.register(model, args.config)
        self.hook = args.hook
        self.last = self._totals()

    def _totals(self):
        if self.hook is None:
            stats = self.state.compression_stats()
            return stats["wire_bytes"], stats["dense_bytes"]
        if self.hook == "powersgd":
            _, before, after = self.state.compression_stats()
            return after, before
        return 0, 0

    def since_last(self, steps: int) -> float:
        """Relative volume of the last ``steps`` steps."""
        totals = self._totals()
        sent, counted = (now - then for now, then in zip(totals, self.last))
        self.last = totals
        if self.hook is None:
            return sent / max(1, counted)
        if self.hook == "powersgd":      # steps before start_powerSGD_iter are plain allreduce, uncounted
            dense = self.numel * steps
            return (sent + dense - counted) / max(1, dense)
        return 0.5 if self.hook == "fp16" else 1.0


def train(args: argparse.Namespace):
    """Run the job on the torchrun world (gloo); return rank 0's per-epoch metrics."""
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_digits_32()
    # DDP broadcasts rank 0's parameters and buffers once; BatchNorm statistics then stay per rank, as in
    # the Horovod job.
    model = DistributedDataParallel(ResNet20(), forward_sync_buffers=False)
    volume = Volume(args, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, args.epochs))
    history = []
    for epoch in range(args.epochs):
        start = time.perf_counter()
        indices = shard(len(y_train), rank, size, epoch, seed=args.seed)
        steps = len(indices) // args.batch_size
        if args.max_steps:
            steps = min(steps, args.max_steps)
        losses = []
        for step in range(steps):
            batch = indices[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(torch.from_numpy(x_train[batch])), torch.from_numpy(y_train[batch]))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        scheduler.step()
        means = torch.tensor([float(np.mean(losses)), volume.since_last(steps)], dtype=torch.float64)
        dist.all_reduce(means)
        means /= size
        record = {"epoch": epoch + 1, "loss": means[0].item(), "acc": job.evaluate(model.module, x_test, y_test),
                  "volume": means[1].item(), "seconds": time.perf_counter() - start}
        history.append(record)
        if rank == 0:
            print(job.EPOCH_LINE.format(acc_pct=100 * record["acc"], **record), flush=True)
    if rank == 0 and args.metrics_json:
        with open(args.metrics_json, "w", encoding="utf-8") as handle:
            json.dump({"config": args.config if args.hook is None else None, "hook": args.hook or "deepreduce",
                       "ranks": size, "epochs": history}, handle, indent=2)
    dist.destroy_process_group()
    return history


if __name__ == "__main__":
    train(parse_args())
