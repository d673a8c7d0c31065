"""The main job: data-parallel ResNet-20 on the digits images, gradients sent as DeepReduce containers.

Run with N ranks under Horovod, e.g.::

    horovodrun -np 2 -H localhost:2 python -m experiments.train --config topk_raw

Each epoch rank 0 prints the training loss (averaged over ranks), the test accuracy, the relative
data volume (bytes this job put on the wire over dense float32 bytes, averaged over ranks) and
the wall time. ``--baseline`` trains with Horovod's own allreduce instead (no compression).

``--profile`` adds, per epoch, the median forward / backward / step milliseconds per step (and,
for deepreduce, where the optimizer's time went). ``--ab`` measures deepreduce's overhead inside
one job: two replicas of the model, started from the same weights, take turns on the same
batches, one with Horovod's dense allreduce and one with the deepreduce optimizer, and each epoch
prints both median step times and their ratio (the epoch line reports the deepreduce replica).

Under ``torchrun`` (``torchrun --nproc-per-node 2 -m experiments.train``, or examples/train_ddp.py)
the same job runs under DistributedDataParallel over gloo: ``--config`` through deepreduce's DDP
communication hook (:mod:`deepreduce.torch.ddp`), ``--baseline`` with DDP's own allreduce, and
``--hook fp16|powersgd`` with PyTorch's own hooks (PowerSGD rank ``--powersgd-rank``, default 4),
so one command compares deepreduce configs with them. Under Horovod the job first applies :mod:`experiments.runtime`'s settings (each only where the
environment does not already set it).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from typing import Dict, List, Optional

import numpy as np

EPOCH_LINE = "epoch {epoch:3d} | train loss {loss:.4f} | test acc {acc_pct:.2f}% | rel volume {volume:.4f} | time {seconds:.1f}s"
PROFILE_LINE = ("profile {label:10s} | forward {forward:7.2f} ms | backward {backward:7.2f} ms | "
                "step {step:7.2f} ms | total {total:7.2f} ms  (medians over {steps} steps)")
OPTIMIZER_LINE = ("optimizer {label:8s} | encode {encode:6.2f} ms (hidden {hidden:6.2f}) | wait for encode "
                  "{encode_wait:6.2f} ms | wait for collectives {comm_wait:6.2f} ms | decode {decode:6.2f} ms  (per step)")
AB_LINE = ("a/b epoch {epoch:3d} | dense {dense:7.2f} ms | deepreduce {deepreduce:7.2f} ms | ratio {ratio:.3f} "
           "(of median step times) | paired {paired:.3f} (median of per-step ratios)")
PHASES = ("forward", "backward", "step")
TORCH_HOOKS = ("fp16", "powersgd")


def add_common_arguments(parser: argparse.ArgumentParser, baseline_help: str, threads_help: str
                         ) -> argparse.ArgumentParser:
    """The options every training job takes (this one, examples/train_tf.py, examples/train_keras.py)."""
    parser.add_argument("--config", default="topk_raw", help="DeepReduce config: a shipped name or a YAML path")
    parser.add_argument("--baseline", action="store_true", help=baseline_help)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (scaled by the number of ranks)")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help=threads_help)
    parser.add_argument("--max-steps", type=int, default=0, help="stop each epoch after this many steps (0: all)")
    parser.add_argument("--metrics-json", default=None, help="rank 0 writes per-epoch metrics here")
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = add_common_arguments(argparse.ArgumentParser(description=__doc__.split("\n")[0]),
                                  "no compression: Horovod allreduce (DDP under torchrun)",
                                  "torch intra-op threads per rank")
    parser.add_argument("--ab", action="store_true",
                        help="alternate dense allreduce and deepreduce every step and print their step-time ratio")
    parser.add_argument("--profile", action="store_true", help="print median forward/backward/step ms per epoch")
    parser.add_argument("--hook", choices=TORCH_HOOKS, default=None,
                        help="under torchrun: one of PyTorch's own DDP hooks instead of deepreduce's")
    parser.add_argument("--powersgd-rank", type=int, default=4, help="matrix_approximation_rank of --hook powersgd")
    parser.add_argument("--sync-encode", action="store_true",
                        help="encode inside the backward hook instead of on the background worker")
    parser.add_argument("--bucket-mb", type=float, default=None, metavar="X",
                        help="compress the gradients in buckets of at most X MiB instead of one container "
                             "each: DistributedOptimizer(bucket_cap_mb=X) under horovodrun, DDP buckets of X "
                             "MiB sent whole (per_parameter=False) under torchrun")
    args = parser.parse_args(argv)
    if args.ab and args.baseline:
        parser.error("--ab already runs the dense baseline beside deepreduce; drop --baseline")
    if args.bucket_mb is not None and (args.baseline or args.hook):
        parser.error("--bucket-mb groups deepreduce's containers; it does not apply to --baseline or --hook")
    if args.hook and (args.baseline or args.ab):
        parser.error("--hook replaces deepreduce by a PyTorch hook; it does not combine with --baseline or --ab")
    return args


def launched_by_torchrun() -> bool:
    """torchrun (torch.distributed.elastic) marks every worker's environment with a run id."""
    return "TORCHELASTIC_RUN_ID" in os.environ


class HorovodWorld:
    """The job's ranks under horovodrun / mpirun: Horovod collectives and optimizers."""

    def __init__(self) -> None:
        from . import runtime

        runtime.apply_defaults()
        import horovod.torch as hvd

        hvd.init()
        self.hvd = hvd
        self.rank, self.size = hvd.rank(), hvd.size()

    def broadcast(self, model) -> None:
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def close(self) -> None:
        """Shut Horovod down once every rank is done."""
        self.hvd.shutdown()

    def mean(self, value: float, name: str) -> float:
        import torch

        return self.hvd.allreduce(torch.tensor(float(value)), name=name).item()

    def dense(self, model, base, args):
        """(model, optimizer, stats) of the uncompressed replica; stats None: volume 1."""
        from deepreduce.errors import ConfigError

        if args.hook:
            raise ConfigError("--hook selects one of PyTorch's DDP hooks: launch with torchrun")
        return model, self.hvd.DistributedOptimizer(base, named_parameters=model.named_parameters()), None

    def deepreduce(self, model, base, args):
        """(model, optimizer, stats) of the deepreduce replica; stats() has "wire_bytes"."""
        import deepreduce.torch as drt

        optimizer = drt.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                             compression=args.config, background=not args.sync_encode,
                                             bucket_cap_mb=args.bucket_mb)
        return model, optimizer, optimizer.compression_stats


class TorchWorld:
    """The job's ranks under torchrun: gloo process group, DistributedDataParallel with a comm hook."""

    def __init__(self) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        self.dist = dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def broadcast(self, model) -> None:
        for tensor in model.state_dict().values():
            self.dist.broadcast(tensor, src=0)

    def close(self) -> None:
        """Leave the gloo group together: a barrier, then its explicit teardown. Left to the
        interpreter's exit, a rank's teardown can meet the peer's closed sockets and abort it
        ("terminate called without an active exception") after all the work is done."""
        self.dist.barrier()
        self.dist.destroy_process_group()

    def mean(self, value: float, name: str) -> float:
        import torch

        total = torch.tensor(float(value))
        self.dist.all_reduce(total)
        return total.item() / self.size

    @staticmethod
    def _ddp(model, **kwargs):
        from torch.nn.parallel import DistributedDataParallel

        # Buffers (BatchNorm statistics) stay per rank after the first broadcast, as under Horovod.
        return DistributedDataParallel(model, forward_sync_buffers=False, **kwargs)

    def dense(self, model, base, args):
        """DDP's allreduce, or with ``--hook`` one of PyTorch's hooks (stats counts its bytes).

        PowerSGD gets the whole model in one bucket: its hook starts collectives from gloo's
        callback threads, and with two buckets in flight their order differs between ranks
        (gloo aborts with "collective mismatch").
        """
        wrapped = self._ddp(model, **({"bucket_cap_mb": 1024} if args.hook == "powersgd" else {}))
        return wrapped, base, torch_hook(wrapped, args) if args.hook else None

    def deepreduce(self, model, base, args):
        """DDP with deepreduce's communication hook; stats is the hook state's. ``--bucket-mb``:
        DDP buckets of that many MiB, each sent whole (``per_parameter=False``)."""
        from deepreduce.torch import ddp

        if args.bucket_mb is None:
            wrapped = self._ddp(model)
        else:
            wrapped = self._ddp(model, bucket_cap_mb=args.bucket_mb)
        return wrapped, base, ddp.register(wrapped, args.config,
                                           per_parameter=args.bucket_mb is None).compression_stats


def torch_hook(model, args):
    """Register PyTorch's fp16 or PowerSGD hook on a DDP ``model``; return a stats callable whose
    "wire_bytes" counts what this rank sent (fp16: 2 bytes an element; PowerSGD: its factors and
    the tensors it leaves uncompressed, and the plain float32 allreduce of its first iterations)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if args.hook == "fp16":
        sent = {"wire_bytes": 0}

        def fp16_hook(state, bucket):
            sent["wire_bytes"] += 2 * bucket.buffer().numel()
            return default_hooks.fp16_compress_hook(state, bucket)

        model.register_comm_hook(None, fp16_hook)
        return lambda: dict(sent)
    numel = sum(p.numel() for p in model.parameters())
    # start_powerSGD_iter=2: the earliest PyTorch allows with error feedback (deepreduce compresses from step 0)
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=args.powersgd_rank, start_powerSGD_iter=2)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return lambda: {"wire_bytes": 4 * (state.total_numel_after_compression
                                       + numel * min(state.iter, state.start_powerSGD_iter))}


class Arm:
    """One model replica with its optimizer; keeps per-step phase timings."""

    def __init__(self, label: str, model, optimizer, scheduler, stats) -> None:
        self.label, self.model, self.optimizer, self.scheduler = label, model, optimizer, scheduler
        self.stats = stats        # callable -> dict with "wire_bytes" (and timings), or None: sends dense
        self.times: Dict[str, List[float]] = {phase: [] for phase in PHASES}

    def step(self, x, y) -> float:
        from torch.nn import functional as F

        start = time.perf_counter()
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        forward_end = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        self.optimizer.step()
        step_end = time.perf_counter()
        for phase, seconds in zip(PHASES, (forward_end - start, backward_end - forward_end, step_end - backward_end)):
            self.times[phase].append(seconds)
        return loss.item()

    def medians_ms(self) -> Dict[str, float]:
        out = {phase: 1e3 * statistics.median(self.times[phase]) for phase in PHASES}
        out["total"] = 1e3 * statistics.median(self.totals())
        return out

    def totals(self) -> List[float]:
        return [sum(parts) for parts in zip(*(self.times[p] for p in PHASES))]

    def reset_times(self) -> None:
        for phase in PHASES:
            self.times[phase].clear()


def evaluate(model, x_test, y_test) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(x_test))
        acc = (logits.argmax(1).numpy() == y_test).mean()
    model.train()
    return float(acc)


def build_arms(world, args) -> List[Arm]:
    """The model replica(s) of this run; the last one is the one the epoch line reports."""
    import torch

    from .models.resnet import ResNet20

    torch.manual_seed(args.seed)
    model = ResNet20()
    world.broadcast(model)
    kinds = ["dense", "deepreduce"] if args.ab else ["dense" if args.baseline or args.hook else "deepreduce"]
    arms = []
    for kind in kinds:
        replica = copy.deepcopy(model) if kind != kinds[-1] else model
        base = torch.optim.SGD(replica.parameters(), lr=args.lr * world.size, momentum=args.momentum,
                               weight_decay=args.weight_decay)
        build = world.dense if kind == "dense" else world.deepreduce
        wrapped, optimizer, stats = build(replica, base, args)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, args.epochs))
        arms.append(Arm(kind, wrapped, optimizer, scheduler, stats))
    return arms


def paired_ratio(dense: Arm, compressed: Arm) -> float:
    """Median over steps of (deepreduce step time / dense step time on the same batch)."""
    return statistics.median(c / d for c, d in zip(compressed.totals(), dense.totals()))


def optimizer_ms(before: dict, after: dict, steps: int) -> Dict[str, float]:
    """Per-step milliseconds of the deepreduce optimizer's phases between two stats snapshots."""
    def per_step(key):
        return 1e3 * (after[key] - before[key]) / max(1, steps)

    return {"encode": per_step("encode_seconds"), "hidden": per_step("encode_hidden_seconds"),
            "encode_wait": per_step("encode_wait_seconds"), "comm_wait": per_step("communication_wait_seconds"),
            "decode": per_step("decode_seconds")}


def train(args: argparse.Namespace) -> List[dict]:
    """Run the job on the current world (Horovod, or torchrun for the baseline); returns rank 0's metrics."""
    import torch

    from .digits import load_digits_32, shard

    world = TorchWorld() if launched_by_torchrun() else HorovodWorld()
    torch.set_num_threads(args.threads)
    x_train, y_train, x_test, y_test = load_digits_32()
    arms = build_arms(world, args)
    reported = arms[-1]
    history = []
    dense_bytes_per_step = 4 * sum(p.numel() for p in reported.model.parameters())
    for epoch in range(args.epochs):
        start = time.perf_counter()
        before = reported.stats() if reported.stats else None
        indices = shard(len(y_train), world.rank, world.size, epoch, seed=args.seed)
        steps = len(indices) // args.batch_size
        if args.max_steps:
            steps = min(steps, args.max_steps)
        losses = []
        for arm in arms:
            arm.reset_times()
        for step in range(steps):
            batch = indices[step * args.batch_size:(step + 1) * args.batch_size]
            x, y = torch.from_numpy(x_train[batch]), torch.from_numpy(y_train[batch])
            order = arms if step % 2 == 0 else arms[::-1]     # alternate who goes first
            for arm in order:
                loss = arm.step(x, y)
                if arm is reported:
                    losses.append(loss)
        for arm in arms:
            arm.scheduler.step()
        record = epoch_record(world, args, epoch, steps, reported, before, losses, dense_bytes_per_step,
                              x_test, y_test, time.perf_counter() - start)
        record["steps"] = steps
        if args.ab or args.profile:
            record["step_ms"] = {arm.label: arm.medians_ms() for arm in arms}
        if args.ab:
            record["ab_ratio"] = paired_ratio(arms[0], arms[1])
        if args.profile and before is not None and "encode_hidden_seconds" in before:   # Horovod optimizer
            record["optimizer_ms"] = optimizer_ms(before, reported.stats(), steps)
        history.append(record)
        if world.rank == 0:
            print_epoch(args, record)
    if world.rank == 0 and args.metrics_json:
        with open(args.metrics_json, "w", encoding="utf-8") as handle:
            json.dump({"config": None if args.baseline or args.hook else args.config, "hook": args.hook,
                       "ranks": world.size,
                       "ab": args.ab, "epochs": history}, handle, indent=2)
    world.close()
    return history


def epoch_record(world, args, epoch, steps, reported, before, losses, dense_bytes_per_step, x_test, y_test,
                 seconds) -> dict:
    volume = 1.0
    if reported.stats:
        after = reported.stats()
        volume = (after["wire_bytes"] - before["wire_bytes"]) / max(1, dense_bytes_per_step * steps)
    model = getattr(reported.model, "module", reported.model)
    return {"epoch": epoch + 1, "loss": world.mean(np.mean(losses), "epoch_loss"),
            "acc": evaluate(model, x_test, y_test), "volume": world.mean(volume, "epoch_volume"),
            "seconds": seconds}


def print_epoch(args, record: dict) -> None:
    print(EPOCH_LINE.format(acc_pct=100 * record["acc"], **record), flush=True)
    for label, medians in record.get("step_ms", {}).items():
        if args.profile:
            print(PROFILE_LINE.format(label=label, steps=record["steps"], **medians), flush=True)
    if "optimizer_ms" in record:
        print(OPTIMIZER_LINE.format(label="deepreduce", **record["optimizer_ms"]), flush=True)
    if args.ab:
        dense, compressed = record["step_ms"]["dense"]["total"], record["step_ms"]["deepreduce"]["total"]
        print(AB_LINE.format(epoch=record["epoch"], dense=dense, deepreduce=compressed, ratio=compressed / dense,
                             paired=record["ab_ratio"]), flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
