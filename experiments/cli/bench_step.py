"""``deepreduce bench-step``: one training step's compression cost over a whole model's gradients.

One table per gradient set (the shipped ResNet-20 gradients, ``experiments/data/gradients.npz``
without ``all``; a ResNet-50-shaped set: its 161 real parameter shapes filled with the seeded
heavy-tailed synthetic gradient of ``deepreduce bench``), one row per method: the time one
step's gradients take to encode on one rank and to decode as a receiver of ``--ranks`` ranks
does, and the bytes one rank sends.

* deepreduce configs run as shipped (error-feedback memory included) through the code the
  PyTorch optimizer runs: ``deepreduce.torch.build(config)``, ``encode(grad, name=, step=)`` of
  every tensor, then per tensor ``decode_sum`` of ``--ranks`` containers: this rank's own and
  ``--ranks - 1`` of a peer's (a second pipeline of the config encoding the negated gradient,
  untimed: same sizes, same decode work); tensors below the config's ``min_numel``
  are summed dense without a container, as the optimizer hands them to Horovod's fused
  all-reduce (``routes.dense.summed_dense``).
* PyTorch's alternatives run as PyTorch ships them (:mod:`experiments.reproduce.torch_hooks`):
  the DDP communication hooks for PowerSGD rank 1 and 4, fp16 and plain all-reduce (the dense
  reference), on a ``DistributedDataParallel`` module whose gradients are the set's, in a
  one-process gloo group; decode includes the reduction of ``--ranks`` contributions.

* ``--bucket-mb X``: each config runs a second time as ``DistributedOptimizer(bucket_cap_mb=X)``
  sends it (:mod:`deepreduce.collective.buckets`): the gradients with a container, in backward order (the
  reverse of the set's), concatenated into buckets of at most X MiB, one container per bucket
  (a gradient that shares no bucket goes on its own); the copies into a bucket and back into
  the ``.grad`` buffers are timed with encode and decode.

* ``torch.topk``: the Top-1% selection alone (``torch.topk`` of the magnitudes of every tensor),
  the floor any Top-r codec builds on.

``--device cpu|cuda`` runs the deepreduce configs on the torch device path
(``deepreduce.torch.build(config, path="device")``: codecs on torch tensors on that device,
decode-accumulate into a tensor there) and puts every method's tensors on that device (the
hooks' group is nccl on CUDA); without it, CPU tensors take the host path (the C++ kernels), as
the optimizer does by default. CUDA times are taken after ``torch.cuda.synchronize()``.

Every method runs ``--warmup`` steps (PowerSGD also its uncompressed and first compressed
iterations), then ``--steps`` timed steps with the step number advancing, so residuals are live;
the table shows per-step medians and the time and volume of each row over PowerSGD rank 4's.
Methods run one after the other (``--interleave``: in turn, step by step).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import glob
import os
import statistics
import time
from typing import Callable, Dict, Iterable, Iterator, List, Tuple

import numpy as np

from ._bench_kernels import peer_payloads
from .bench import steps_after_warmup

SETS = ("resnet20", "resnet50", "resnet50_flat")
TOPK_RATIO = 0.01


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench-step", help="per-step encode+decode time and volume over a whole "
                                                      "model's gradients, beside PowerSGD and fp16")
    parser.add_argument("configs", nargs="*",
                        help="config files (default: every configs/*.yaml with a sparsifier, as shipped)")
    parser.add_argument("--sets", default=",".join(SETS),
                        help="comma-separated gradient sets: resnet20 (the shipped real gradients), "
                             "resnet50 (ResNet-50's shapes, synthetic values), resnet50_flat (the same "
                             "25,557,032 values as one tensor)")
    parser.add_argument("--gradients", default=None, metavar="NPZ",
                        help="an .npz of named gradients to use instead of --sets")
    parser.add_argument("--ranks", type=int, default=2, help="ranks whose containers a receiver decodes")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per method (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic ResNet-50 gradients")
    parser.add_argument("--threads", default="auto",
                        help="threads of deepreduce's kernels and PyTorch's ops alike (a positive integer; "
                             "default auto: usable CPUs // --ranks, what threads: auto gives each rank "
                             "when the ranks share this host)")
    parser.add_argument("--device", default=None, choices=("cpu", "cuda"),
                        help="run the deepreduce configs on the torch device path on this device, and "
                             "every method's tensors there (default: CPU tensors, host path)")
    parser.add_argument("--bucket-mb", type=float, default=None, metavar="X",
                        help="also run each config with its gradients in buckets of at most X MiB, as "
                             "DistributedOptimizer(bucket_cap_mb=X) sends them")
    parser.add_argument("--interleave", action="store_true",
                        help="step all methods in turn (steadier ratios on a busy machine; holds every "
                             "method's state at once: several GB for resnet50)")
    parser.set_defaults(func=run)


# ---------------------------------------------------------------------------- gradient sets
def resnet20_gradients() -> Dict[str, np.ndarray]:
    """The shipped real ResNet-20 gradients by parameter name (without the concatenated ``all``)."""
    from ..gradients import load

    return {name: grad for name, grad in load().items() if name != "all"}


def resnet50_gradients(seed: int) -> Dict[str, np.ndarray]:
    """ResNet-50's parameter shapes filled, in order, with one seeded heavy-tailed synthetic vector."""
    from ..models.resnet50_shapes import parameter_shapes
    from .bench import synthetic_gradient

    shapes = parameter_shapes()
    sizes = [int(np.prod(shape)) for _, shape in shapes]
    flat = synthetic_gradient(sum(sizes), seed)
    ends = np.cumsum(sizes)
    return {name: flat[end - size:end].reshape(shape) for (name, shape), size, end in zip(shapes, sizes, ends)}


def resnet50_flat(seed: int) -> Dict[str, np.ndarray]:
    """The ResNet-50 set's values as one tensor (d = 25,557,032)."""
    grads = resnet50_gradients(seed)
    return {"resnet50.flat": np.concatenate([g.reshape(-1) for g in grads.values()])}


def gradient_sets(args) -> List[Tuple[str, Callable[[], Dict[str, np.ndarray]]]]:
    """(title, loader of the gradients by name) for each requested set, checked before any runs."""
    from deepreduce.errors import ConfigError

    if args.gradients:
        if not os.path.isfile(args.gradients):
            raise ConfigError(f"bench-step: no gradient file {args.gradients!r}")

        def from_file():
            with np.load(args.gradients) as data:
                return {name: data[name].astype(np.float32) for name in data.files}
        return [(os.path.basename(args.gradients), from_file)]
    known = {"resnet20": ("ResNet-20 gradients (shipped, real)", resnet20_gradients),
             "resnet50": (f"ResNet-50 shapes, synthetic Laplace gradient (seed {args.seed})",
                          functools.partial(resnet50_gradients, args.seed)),
             "resnet50_flat": (f"ResNet-50's parameters as one tensor, synthetic Laplace gradient (seed {args.seed})",
                               functools.partial(resnet50_flat, args.seed))}
    names = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ConfigError(f"bench-step: unknown gradient set {(unknown or [''])[0]!r}; known: {', '.join(SETS)}")
    return [known[name] for name in names]


def default_configs() -> List[str]:
    """Every shipped config whose sparsifier selects entries (the ones meant for dense gradients)."""
    from deepreduce.config import load_config

    from ..reproduce.common import default_configs_dir

    paths = sorted(glob.glob(os.path.join(default_configs_dir(), "*.yaml")))
    return [p for p in paths if load_config(p)["sparsifier"]["id"] != "none"]


# ---------------------------------------------------------------------------- measurements
class ConfigRunner:
    """One deepreduce config through the optimizer's calls; ``step()`` times one training step."""

    extra_warmup = 0

    def __init__(self, path: str, grads: Dict[str, np.ndarray], ranks: int, threads: int, device=None,
                 bucket_mb=None) -> None:
        from deepreduce.collective.buckets import MIB, check_bucket_cap, plan
        from deepreduce.config import load_config
        from deepreduce.torch import build

        self.method = os.path.splitext(os.path.basename(path))[0]
        if check_bucket_cap(bucket_mb, "bench-step --bucket-mb") is not None:
            self.method += f" ({bucket_mb:g} MiB buckets)"
        config = dict(load_config(path), threads=threads)
        self.pipe = build(config, path="auto" if device is None else "device")
        self.peer = build(config, path="auto" if device is None else "device")
        # the first step after any dense warm-up: the codec's steady state is what is measured
        self.grads, self.ranks, self.device = grads, ranks, device or "cpu"
        self.step_number = steps_after_warmup(self.pipe, 1).start
        self.grad_buffers: Dict[str, object] = {}
        # As in the optimizer: the gradients with a container, in backward order (the reverse of
        # the set's), grouped into buckets of two or more; the others travel on their own.
        coded = [name for name, g in grads.items() if not self._summed(g.size)][::-1]
        self.buckets = [] if bucket_mb is None else [
            (f"bucket{k}.{coded[members[0]]}", [coded[i] for i in members])
            for k, members in enumerate(plan([grads[n].size for n in coded], bucket_mb * MIB))]

    def _summed(self, numel: int) -> bool:
        """A small CPU tensor that ``routes.dense.summed_dense`` lets skip the container."""
        from deepreduce.collective.routes.dense import summed_dense

        return self.device == "cpu" and summed_dense(self.pipe.core, numel)

    def _grad_buffer(self, name: str, tensor):
        """The tensor's decode target, kept across steps like a parameter's ``.grad``."""
        if name not in self.grad_buffers:
            self.grad_buffers[name] = tensor.new_empty(tensor.shape)
        return self.grad_buffers[name]

    def _items(self, coded: Dict[str, object]) -> list:
        """(name, tensor) pairs to encode: each bucket's gradients concatenated (the optimizer's
        copy into its bucket), then every gradient that shares no bucket."""
        import torch

        grouped = {n for _, members in self.buckets for n in members}
        return [(name, torch.cat([coded[n].reshape(-1) for n in members])) for name, members in self.buckets] + \
            [(n, t) for n, t in coded.items() if n not in grouped]

    def step(self) -> Tuple[float, float, int]:
        """Encode every gradient (or bucket), then decode-and-sum ``ranks`` containers of each into
        its ``.grad``-like buffer (as the optimizer decodes into ``p.grad``; a bucket's slices are
        then copied back): (s, s, bytes).

        As in the optimizer, a small CPU tensor that ``routes.dense.summed_dense`` lets skip the
        container is summed by the all-reduce instead: no encode, its "decode" is the sum of
        ``ranks`` contributions, its bytes the dense ones."""
        import torch

        tensors = [(name, torch.from_numpy(grad.copy()).to(self.device)) for name, grad in self.grads.items()]
        summed = [t for _, t in tensors if self._summed(t.numel())]
        coded = {name: t for name, t in tensors if not self._summed(t.numel())}
        received = peer_payloads(self.peer, self._items(coded), self.step_number)
        members = dict(self.buckets)
        t0 = _now(self.device)                                                                # fresh p.grad
        items = self._items(coded)
        payloads = [self.pipe.encode(tensor, name=name, step=self.step_number) for name, tensor in items]
        t1 = _now(self.device)
        for (name, tensor), payload, other in zip(items, payloads, received):
            out = self._grad_buffer(name, tensor)
            self.pipe.decode_sum([payload] + [other] * (self.ranks - 1), expected_shape=tuple(tensor.shape), out=out)
            at = 0
            for grad_name in members.get(name, ()):                                          # the copy-back
                grad = coded[grad_name]
                self._grad_buffer(grad_name, grad).copy_(out[at:at + grad.numel()].view_as(grad))
                at += grad.numel()
        for tensor in summed:
            total = tensor.clone()
            for _ in range(self.ranks - 1):
                total += tensor
        t2 = _now(self.device)
        self.step_number += 1
        return t1 - t0, t2 - t1, sum(int(p.numel()) for p in payloads) + sum(4 * t.numel() for t in summed)


class TopkRunner:
    """``torch.topk`` of every tensor's magnitudes at the Top-r configs' 1%: the selection alone."""

    extra_warmup = 0
    method = "torch.topk (1%)"

    def __init__(self, grads: Dict[str, np.ndarray], device=None) -> None:
        import torch

        self.device = device or "cpu"
        self.tensors = [torch.from_numpy(grad).to(self.device).reshape(-1) for grad in grads.values()]

    def step(self) -> Tuple[float, float, int]:
        import torch

        t0 = _now(self.device)
        chosen = [torch.topk(t.abs(), max(1, int(TOPK_RATIO * t.numel())), sorted=False) for t in self.tensors]
        t1 = _now(self.device)
        return t1 - t0, 0.0, sum(8 * int(c.indices.numel()) for c in chosen)


def _now(device) -> float:
    """``time.perf_counter()`` after the device's queued work is done."""
    if device is not None and str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    return time.perf_counter()


class HookRunner:
    """One PyTorch DDP hook on a module whose gradients are the set's (needs a process group)."""

    def __init__(self, method: dict, targets: list, ranks: int) -> None:
        from torch.nn.parallel import DistributedDataParallel

        from ..reproduce import torch_hooks

        self.method = torch_hooks.label(method)
        self.extra_warmup = torch_hooks.warmup_iterations(method)
        self.timer = torch_hooks.HookTimer(emulated_ranks=ranks)
        # the module's parameters on the gradients' device: DDP checks them with a collective of
        # the group's backend (nccl takes CUDA tensors only)
        device = targets[0].device if targets else None
        self.model = DistributedDataParallel(gradient_module([t.shape for t in targets]).to(device))
        self.state = torch_hooks.register(self.model, method, self.timer)
        self.targets = targets

    def step(self) -> Tuple[float, float, int]:
        """Forward and backward (untimed); the hook's encode and decode time and bytes."""
        self.model.zero_grad(set_to_none=True)
        loss = self.model(self.targets)
        self.timer.reset()
        with self.timer:
            loss.backward()
        return self.timer.encode_s, self.timer.decode_s, self.timer.bytes


def gradient_module(shapes):
    """A module with parameters of ``shapes`` whose ``forward(g)`` is ``sum <p, g>``: backward leaves
    exactly ``g`` in the gradients, which DDP hands to its communication hook."""
    import torch

    class GradientSet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(shape)) for shape in shapes)

        def forward(self, grads):
            return sum((w * g).sum() for w, g in zip(self.weights, grads))

    return GradientSet()


@contextlib.contextmanager
def one_process_group(backend: str = "gloo"):
    """A one-process group (gloo; nccl for CUDA tensors) for PyTorch's hooks, destroyed afterwards."""
    import torch.distributed as dist

    from deepreduce.errors import DeepReduceError

    if dist.is_initialized():
        raise DeepReduceError("bench-step runs PyTorch's hooks in its own one-process group; "
                              "run it outside torch.distributed")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def measure(factories: list, steps: int, warmup: int, interleave: bool = False) -> Iterator[dict]:
    """Time every method: ``warmup`` (plus its own) untimed steps, then ``steps`` timed ones.

    ``factories`` build the runners. By default the methods run one after the other, each row
    is yielded as soon as it is measured, and only one method's state (residuals, DDP buckets)
    lives at a time. With ``interleave`` every runner is built first and each round steps every
    method once, so all share a busy machine's load alike and the ratios hold while absolute
    times drift; it holds every method's state at once (several GB for the ResNet-50 set).
    """
    def warm(runner):
        for _ in range(warmup + runner.extra_warmup):
            runner.step()
        return runner

    if interleave:
        runners = [warm(make()) for make in factories]
        samples = [[] for _ in runners]
        for _ in range(steps):
            for runner, sample in zip(runners, samples):
                sample.append(runner.step())
        yield from (_row(runner.method, sample) for runner, sample in zip(runners, samples))
        return
    for make in factories:
        runner = warm(make())
        row = _row(runner.method, [runner.step() for _ in range(steps)])
        del runner
        gc.collect()                      # DDP's reducer holds cycles: free its buckets now
        yield row


def _row(method: str, samples: List[Tuple[float, float, int]]) -> dict:
    """Per-step medians of one method's (encode s, decode s, bytes) samples."""
    encode, decode, sent = zip(*samples)
    return {"method": method, "encode_ms": 1e3 * statistics.median(encode),
            "decode_ms": 1e3 * statistics.median(decode),
            "total_ms": 1e3 * statistics.median([e + d for e, d in zip(encode, decode)]),
            "bytes": int(statistics.median(sent))}


# ---------------------------------------------------------------------------- output
COLUMNS = f"{'method':<28} {'encode_ms':>10} {'decode_ms':>10} {'total_ms':>10} {'bytes':>11} " \
          f"{'vs_dense':>9} {'time/PSGD4':>10} {'vol/PSGD4':>10}"


def print_table(title: str, grads: Dict[str, np.ndarray], rows: Iterable[dict], args) -> None:
    """Print rows as they come, each with its volume over dense float32 and its time and volume
    over the reference row's (PowerSGD rank 4, measured first)."""
    numel = sum(g.size for g in grads.values())
    print(f"\n{title}: {len(grads)} tensors, {numel:,} parameters; {args.ranks} ranks; "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(COLUMNS)
    print("-" * len(COLUMNS), flush=True)
    ref = None
    for r in rows:
        ref = ref or r
        print(f"{r['method']:<28} {r['encode_ms']:>10.3f} {r['decode_ms']:>10.3f} {r['total_ms']:>10.3f} "
              f"{r['bytes']:>11} {r['bytes'] / (4 * numel):>9.4f} {r['total_ms'] / ref['total_ms']:>10.3f} "
              f"{r['bytes'] / ref['bytes']:>10.3f}", flush=True)


def run(args) -> int:
    import torch

    from deepreduce.backend.parallel import AUTO, check_threads, usable_cpus
    from deepreduce.errors import ConfigError

    from ..reproduce import torch_hooks

    if min(args.ranks, args.steps) < 1 or args.warmup < 0:
        raise ConfigError("bench-step: --ranks and --steps must be at least 1, --warmup at least 0")
    threads = check_threads(_threads_option(args.threads), "bench-step --threads")
    if threads == AUTO:
        threads = max(1, usable_cpus() // args.ranks)
    torch.set_num_threads(threads)
    paths = args.configs or default_configs()
    hooks = [torch_hooks.spec("powersgd", 4), torch_hooks.spec("powersgd", 1), torch_hooks.spec("fp16"),
             torch_hooks.spec("allreduce")]          # the reference first: later rows print ratios to it
    where = "host path (C++ kernels on CPU tensors)" if args.device is None else \
        f"torch device path on {args.device} (path='device')"
    print(f"torch {torch.__version__}; {threads} thread(s) for deepreduce's kernels and PyTorch's ops; "
          f"deepreduce configs as shipped (memory included) through deepreduce.torch.build(config)"
          f".encode/decode_sum, {where}")
    for title, load in gradient_sets(args):
        grads = load()
        targets = [torch.from_numpy(grad).to(args.device or "cpu") for grad in grads.values()]
        with one_process_group("nccl" if args.device == "cuda" else "gloo"):
            factories = [functools.partial(HookRunner, method, targets, args.ranks) for method in hooks]
            factories.append(functools.partial(TopkRunner, grads, args.device))
            caps = [None] if args.bucket_mb is None else [None, args.bucket_mb]
            factories += [functools.partial(ConfigRunner, path, grads, args.ranks, threads, args.device, cap)
                          for path in paths for cap in caps]
            print_table(title, grads, measure(factories, args.steps, args.warmup, args.interleave), args)
    return 0


def _threads_option(text: str):
    """``--threads`` as the pipeline option: an int when it spells one, else the text itself
    ("auto", or something the option's check rejects by name)."""
    try:
        return int(text)
    except ValueError:
        return text
