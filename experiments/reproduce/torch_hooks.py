"""PyTorch's own gradient compression as PyTorch users run it: DDP communication hooks, timed.

fig11 and ``deepreduce bench-step`` set deepreduce beside what a PyTorch user would pick
instead: ``powerSGD_hook`` with a ``PowerSGDState`` (rank 1 or 4) and ``fp16_compress_hook``
from ``torch.distributed.algorithms.ddp_comm_hooks``, registered on a
``DistributedDataParallel`` model (``allreduce_hook``, DDP's own behaviour, is the dense
reference). The state is PyTorch's default (error feedback, warm start, ``min_compression_rate``
2, DDP's buckets) except ``start_powerSGD_iter = 2``, the smallest PyTorch allows with error
feedback, so that short runs measure compressed iterations.

:class:`HookTimer` splits a hook's time into encode, communication and decode. While it is
active, every ``torch.distributed.all_reduce`` (what the hooks call) waits where it is issued
and its wait is timed; the hooks' ``then`` callbacks then run inline, so a hook's wall time is
its codec work plus those waits. Encode is everything before the hook's last collective
(compensation, ``P = M Q``, orthogonalisation, ``Q = M^T P``; the fp16 cast), decode everything
after it (``P Q^T`` and the error update; the cast back). Waiting in place costs no overlap
when the hook fires after backward, as in fig11 and the benchmark.
"""
from __future__ import annotations

import time
from typing import List, Optional

START_POWERSGD_ITER = 2
KINDS = ("allreduce", "fp16", "powersgd")


def spec(kind: str, rank: Optional[int] = None) -> dict:
    """A method description that travels in JSON: ``{"ddp_hook": kind[, "rank": r]}``."""
    if kind not in KINDS:
        raise ValueError(f"unknown DDP hook {kind!r}; known: {', '.join(KINDS)}")
    if (kind == "powersgd") != (rank is not None):
        raise ValueError("a rank goes with the powersgd hook, and only with it")
    return {"ddp_hook": kind} if rank is None else {"ddp_hook": kind, "rank": int(rank)}


def is_hook(method) -> bool:
    """Whether a method description names a PyTorch DDP hook (not a deepreduce config)."""
    return isinstance(method, dict) and "ddp_hook" in method


def label(method: dict) -> str:
    """The row label of a hook method."""
    kind = method["ddp_hook"]
    if kind == "powersgd":
        return f"PowerSGD rank {method['rank']}"
    return {"fp16": "fp16", "allreduce": "dense (no compression)"}[kind]


def warmup_iterations(method: dict) -> int:
    """Iterations before the hook runs as it does in steady state.

    PowerSGD all-reduces uncompressed for ``START_POWERSGD_ITER`` iterations, and its first
    compressed one allocates and draws the low-rank factors that warm start reuses afterwards.
    """
    return START_POWERSGD_ITER + 1 if method["ddp_hook"] == "powersgd" else 0


def make(method: dict):
    """PyTorch's ``(state, hook)`` for ``method``, as ``model.register_comm_hook`` takes them."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    kind = method["ddp_hook"]
    if kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=method["rank"],
                                            start_powerSGD_iter=START_POWERSGD_ITER)
        return state, powerSGD_hook.powerSGD_hook
    # the default process group
    return None, default_hooks.fp16_compress_hook if kind == "fp16" else default_hooks.allreduce_hook


def register(model, method: dict, timer: "HookTimer"):
    """Register the hook of ``method`` (timed by ``timer``) on the DDP ``model``; return its state."""
    state, hook = make(method)
    model.register_comm_hook(state, timer.wrap(hook))
    return state


def _clock() -> float:
    """``time.perf_counter()`` once the GPU's queued work is done (CUDA in use), else at once."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


class HookTimer:
    """Times DDP communication hooks: encode, collective waits, decode, and bytes all-reduced.

    Use ``with timer:`` around the backward pass (the hooks fire inside it), ``reset()`` before
    each iteration, then read ``encode_s``, ``decode_s``, ``comm_s`` and ``bytes``.

    ``emulated_ranks`` is for single-process benchmarks, where an all-reduce has nothing to add:
    the sum of that many contributions (what the collective computes) is timed on a copy of the
    buffer after each all-reduce and counted as decode, the work a receiver's ``decode_sum`` does.
    """

    def __init__(self, emulated_ranks: int = 1) -> None:
        if emulated_ranks < 1:
            raise ValueError(f"emulated_ranks must be at least 1, got {emulated_ranks}")
        self.emulated_ranks = emulated_ranks
        self._collectives: List[tuple] = []
        self._saved = None
        self.reset()

    def reset(self) -> None:
        self.encode_s = self.decode_s = self.comm_s = 0.0
        self.bytes = 0

    def wrap(self, hook):
        """``hook`` with its wall time split into encode, communication and decode."""
        def timed_hook(state, bucket):
            self._collectives = []
            start = _clock()
            future = hook(state, bucket)
            future.wait()
            end = _clock()
            self._account(start, end)
            return future
        timed_hook.__name__ = f"timed_{getattr(hook, '__name__', 'hook')}"
        return timed_hook

    def _account(self, start: float, end: float) -> None:
        if not self._collectives:
            self.encode_s += end - start
            return
        *earlier, last = self._collectives
        self.comm_s += sum(done - issued for issued, done, _ in self._collectives)
        self.encode_s += last[0] - start - sum(reduced - issued for issued, _, reduced in earlier)
        self.decode_s += end - last[1] + sum(reduced - done for _, done, reduced in earlier)

    def _all_reduce(self, tensor, *args, **kwargs):
        wanted_async = kwargs.pop("async_op", False)
        issued = _clock()
        work = self._saved(tensor, *args, async_op=True, **kwargs)
        work.wait()
        done = _clock()
        if self.emulated_ranks > 1:
            total = tensor.clone()        # the collective reduces into a buffer already in use
            done = _clock()
            for _ in range(self.emulated_ranks - 1):
                total.add_(tensor)
        self._collectives.append((issued, done, _clock()))
        self.bytes += tensor.numel() * tensor.element_size()
        return work if wanted_async else None

    def __enter__(self) -> "HookTimer":
        import torch.distributed as dist

        self._saved = dist.all_reduce
        dist.all_reduce = self._all_reduce
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        dist.all_reduce = self._saved
        self._saved = None
