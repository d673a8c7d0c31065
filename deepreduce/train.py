"""The main job: data-parallel ResNet-20 on the digits images, gradients sent as DeepReduce containers.

Run with N ranks under Horovod, e.g.::

    horovodrun -np 2 -H localhost:2 python -m deepreduce.train --config configs/topk_raw.yaml

Each epoch rank 0 prints the training loss (averaged over ranks), the test accuracy, the relative
data volume (bytes this job put on the wire over dense float32 bytes, averaged over ranks) and
the wall time. ``--baseline`` trains with Horovod's own allreduce instead (no compression).
"""
from __future__ import annotations

import argparse
import json
import time
from typing import List, Optional

import numpy as np

EPOCH_LINE = "epoch {epoch:3d} | train loss {loss:.4f} | test acc {acc_pct:.2f}% | rel volume {volume:.4f} | time {seconds:.1f}s"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/topk_raw.yaml", help="DeepReduce config (YAML)")
    parser.add_argument("--baseline", action="store_true", help="no compression: Horovod allreduce")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (scaled by the number of ranks)")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--max-steps", type=int, default=0, help="stop each epoch after this many steps (0: all)")
    parser.add_argument("--metrics-json", default=None, help="rank 0 writes per-epoch metrics here")
    return parser.parse_args(argv)


def evaluate(model, x_test, y_test) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(x_test))
        acc = (logits.argmax(1).numpy() == y_test).mean()
    model.train()
    return float(acc)


def train(args: argparse.Namespace) -> List[dict]:
    """Run the job on the current Horovod world; returns rank 0's per-epoch metrics."""
    import horovod.torch as hvd
    import torch
    from torch.nn import functional as F

    import deepreduce.torch as drt
    from deepreduce.data import load_digits_32, shard
    from deepreduce.models.resnet import ResNet20

    hvd.init()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_digits_32()
    model = ResNet20()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    base = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum,
                           weight_decay=args.weight_decay)
    if args.baseline:
        optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    else:
        optimizer = drt.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                             compression=args.config)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, args.epochs))
    history = []
    dense_bytes_per_step = 4 * sum(p.numel() for p in model.parameters())
    for epoch in range(args.epochs):
        start = time.perf_counter()
        before = None if args.baseline else optimizer.compression_stats()
        indices = shard(len(y_train), hvd.rank(), hvd.size(), epoch, seed=args.seed)
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
        if args.baseline:
            volume = 1.0
        else:
            after = optimizer.compression_stats()
            volume = (after["wire_bytes"] - before["wire_bytes"]) / max(1, dense_bytes_per_step * steps)
        mean_loss = hvd.allreduce(torch.tensor(float(np.mean(losses))), name="epoch_loss").item()
        mean_volume = hvd.allreduce(torch.tensor(volume), name="epoch_volume").item()
        record = {"epoch": epoch + 1, "loss": mean_loss, "acc": evaluate(model, x_test, y_test),
                  "volume": mean_volume, "seconds": time.perf_counter() - start}
        history.append(record)
        if hvd.rank() == 0:
            print(EPOCH_LINE.format(acc_pct=100 * record["acc"], **record), flush=True)
    if hvd.rank() == 0 and args.metrics_json:
        with open(args.metrics_json, "w", encoding="utf-8") as handle:
            json.dump({"config": None if args.baseline else args.config, "ranks": hvd.size(),
                       "epochs": history}, handle, indent=2)
    return history


def main(argv: Optional[List[str]] = None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
