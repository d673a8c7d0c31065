"""Buckets of ``DistributedOptimizer``: the gradients of consecutive parameters compressed as one
flat tensor (the plan itself is :mod:`deepreduce.collective.buckets`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch

from ..collective import buckets


@dataclass(eq=False)
class GradBucket:
    """Gradients of consecutive parameters sent as one tensor."""
    name: str
    label: str                    # its name and its parameters', for errors
    params: List[torch.Tensor]
    offsets: List[int]
    buffer: torch.Tensor          # flat float32, on the parameters' device
    waiting: int = 0              # gradients of this step not yet copied in

    def slice(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i]:self.offsets[i] + p.numel()]

    def add(self, i: int, grad: torch.Tensor) -> bool:
        """Copy parameter ``i``'s finished gradient into its slice; whether the bucket is full."""
        with torch.no_grad():
            self.slice(i).copy_(grad.reshape(-1))
        self.waiting -= 1
        return not self.waiting

    def copy_back(self) -> None:
        """Write each parameter's slice of the (reduced) buffer into its ``grad``."""
        with torch.no_grad():
            for i, q in enumerate(self.params):
                q.grad.copy_(self.slice(i).view_as(q))

    def reset(self) -> None:
        self.waiting = len(self.params)


def plan(params: List[torch.Tensor], names: Dict[torch.Tensor, str], cap_mb: float,
         eligible: Callable[[torch.Tensor], bool]) -> Tuple[List[GradBucket], Dict[torch.Tensor, tuple]]:
    """Buckets of at most ``cap_mb`` MiB of the ``eligible`` float32 gradients, per device, in
    backward order (the reverse of the parameters'); and ``{parameter: (bucket, its index)}``."""
    out, where = [], {}
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for p in reversed(params):
        if p.dtype == torch.float32 and eligible(p):
            by_device.setdefault(p.device, []).append(p)
    for device, group in by_device.items():
        for members in buckets.plan([p.numel() for p in group], cap_mb * buckets.MIB):
            chosen = [group[i] for i in members]
            sizes = [p.numel() for p in chosen]
            name = f"bucket{len(out)}.{names[chosen[0]]}"
            bucket = GradBucket(name, f"{name!r} (parameters {', '.join(names[p] for p in chosen)})", chosen,
                                buckets.offsets(sizes), torch.empty(sum(sizes), dtype=torch.float32, device=device),
                                len(chosen))
            out.append(bucket)
            for i, p in enumerate(chosen):
                where[p] = (bucket, i)
    return out, where
