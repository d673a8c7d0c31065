"""The step engine's tensor port for torch (:class:`deepreduce.collective.ports.Tensors`): how
the engine and its routes read and write torch tensors, on any device."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from . import sparse


class TorchTensors:
    """Stateless; one instance serves every torch binding."""

    @staticmethod
    def host(tensor: torch.Tensor) -> np.ndarray:
        """A flat float32 NumPy view of a CPU float32 tensor, else a host copy."""
        flat = tensor.detach().reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.to(torch.float32)
        return flat.cpu().numpy()

    @staticmethod
    def write(target: torch.Tensor, flat: np.ndarray) -> None:
        """Copy ``flat`` into ``target``; nothing to copy where ``flat`` is :meth:`host`'s view of it."""
        source = torch.from_numpy(flat)
        if source.data_ptr() == target.data_ptr() and target.dtype == torch.float32 and target.is_contiguous() \
                and source.numel() == target.numel():
            return
        with torch.no_grad():
            target.copy_(source.view(target.shape))

    @staticmethod
    def copy(target: torch.Tensor, source: torch.Tensor) -> None:
        with torch.no_grad():
            target.copy_(source.view(target.shape))

    @staticmethod
    def divide(target: torch.Tensor, ranks: int) -> None:
        with torch.no_grad():
            target.div_(ranks)

    @staticmethod
    def add(target: torch.Tensor, flat: np.ndarray) -> None:
        with torch.no_grad():
            target.add_(torch.from_numpy(flat).view(target.shape).to(target.device, target.dtype))

    @staticmethod
    def with_flag(tensor, dtype: str, flag: float) -> torch.Tensor:
        """A new flat tensor of ``tensor``'s elements (or of a list of tensors', end to end) in
        ``dtype`` (``"same"``: their own), zeros where ``flag`` is set, then one element holding
        ``flag`` (the all-reduce routes' flag)."""
        parts = list(tensor) if isinstance(tensor, (list, tuple)) else [tensor]
        kind = parts[0].dtype if dtype == "same" else getattr(torch, dtype)
        numel = sum(part.numel() for part in parts)
        out = torch.empty(numel + 1, dtype=kind, device=parts[0].device)
        with torch.no_grad():
            if flag:
                out.zero_()
            else:
                at = 0
                for part in parts:
                    out[at:at + part.numel()].copy_(part.detach().reshape(-1))
                    at += part.numel()
            out[-1] = flag
        return out

    @staticmethod
    def split_flag(summed: torch.Tensor):
        """(the data, a view; the flag's value) of a tensor :meth:`with_flag` made, after its all-reduce."""
        return summed[:-1], float(summed[-1])

    @staticmethod
    def like(flat: torch.Tensor, shaped: torch.Tensor) -> torch.Tensor:
        """``flat`` viewed in ``shaped``'s shape."""
        return flat.view(shaped.shape)

    @staticmethod
    def all_finite(tensor: torch.Tensor) -> bool:
        return bool(torch.isfinite(tensor).all())

    @staticmethod
    def float32(tensor: torch.Tensor) -> bool:
        return tensor.dtype == torch.float32

    entries = staticmethod(sparse.entries)
    from_entries = staticmethod(sparse.from_entries)

    @staticmethod
    def is_sparse(tensor: torch.Tensor) -> bool:
        return tensor.is_sparse

    @staticmethod
    def numel(tensor: torch.Tensor) -> int:
        return tensor.numel()

    @staticmethod
    def shape(tensor: torch.Tensor) -> Sequence[int]:
        return tuple(tensor.shape)
