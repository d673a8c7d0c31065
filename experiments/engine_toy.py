"""The toy model of ``deepreduce bench-scaling --real-engine``, in one place for the ranks that time
it (:mod:`experiments.engine_scaling_worker`) and the cost model that predicts it
(:func:`compute_cpu_s`): one parameter per tensor size, a fixed Laplace gradient per rank and step
(``loss = sum(p * g)``, so ``p.grad == g``)."""
from __future__ import annotations

import statistics
import time
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch


def gradients(numels: Sequence[int], rank: int, step: int, seed: int) -> List[torch.Tensor]:
    """Rank ``rank``'s gradients of step ``step``."""
    return [torch.from_numpy(np.random.default_rng([seed, rank, step, n]).laplace(size=n).astype(np.float32))
            for n in numels]


def parameters(numels: Sequence[int]) -> torch.nn.ParameterList:
    torch.manual_seed(0)
    return torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in numels])


def forward_backward(params, grads) -> None:
    """The step's compute: ``loss = sum(p * g)`` and its backward (each ``p.grad`` becomes ``g``)."""
    sum((p * g).sum() for p, g in zip(params, grads)).backward()


def compute_cpu_s(numels: Sequence[int], steps: int = 9, seed: int = 0, rank: int = 0,
                  before: Optional[Callable[[], None]] = None) -> float:
    """Median CPU seconds of the toy step's compute, with one thread and no reduction (gradients
    set to None first, as ``zero_grad()`` does): the model's compute term. Alone in this process by
    default; in a launch of N ranks, ``before`` (a barrier) makes every rank time it together, so
    the figure holds what sharing the cores' caches and memory bandwidth costs at that N."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        params, samples = parameters(numels), []
        for step in range(steps + 1):
            grads = gradients(numels, rank, step, seed)
            for p in params:
                p.grad = None
            if before is not None:
                before()
            start = time.process_time()
            forward_backward(params, grads)
            if step:
                samples.append(time.process_time() - start)
        return statistics.median(samples)
    finally:
        torch.set_num_threads(threads)
