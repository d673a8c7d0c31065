"""The PyTorch face of a pipeline: torch tensors in, the core's exact bytes out.

Encoding hands the gradient to the framework-neutral core, so the container is byte-identical
to ``deepreduce.build(config).encode`` for the same input, name and step.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from ..config import ConfigLike, build as build_core
from ..pipeline import Pipeline
from .sparsify import select_torch


class TorchPipeline:
    """Wraps a core :class:`~deepreduce.Pipeline` for torch tensors.

    ``encode(tensor, name=, step=)`` returns a 1-D ``torch.uint8`` CPU tensor; ``decode(payload)``
    returns a float32 tensor of the original shape (on ``device``, default CPU).
    """

    def __init__(self, core: Pipeline) -> None:
        self.core = core

    @property
    def stats(self):
        return self.core.stats

    def get_config(self) -> dict:
        return self.core.get_config()

    def encode(self, tensor: torch.Tensor, name: str = "", step: int = 0) -> torch.Tensor:
        """Encode ``tensor``; the sparsifier runs as torch code on the tensor's device.

        The codecs run on the CPU copy (they need the dense values, e.g. Bloom P0). Without
        error feedback the selection reads the device tensor itself; with it, the compensated
        gradient (kept by the core) is what the selection reads.
        """
        grad = tensor.detach()
        if grad.dtype != torch.float32:
            grad = grad.float()
        flat_device = grad.reshape(-1)
        stateless = not self.core.memory.stateful

        def select(compensated: np.ndarray, ctx) -> np.ndarray:
            source = flat_device if stateless else torch.from_numpy(compensated).to(flat_device.device)
            return select_torch(self.core.sparsifier, source, ctx).cpu().numpy()

        payload = self.core.encode(grad.cpu().numpy(), name=name, step=int(step), select=select)
        return torch.from_numpy(payload)

    def decode(self, payload, expected_shape: Optional[Sequence[int]] = None,
               device: Optional[torch.device] = None) -> torch.Tensor:
        dense = self.core.decode(_as_numpy(payload), expected_shape)
        out = torch.from_numpy(np.ascontiguousarray(dense))
        return out if device is None else out.to(device)

    def decode_sum(self, payloads, expected_shape: Optional[Sequence[int]] = None,
                   device: Optional[torch.device] = None) -> torch.Tensor:
        dense = self.core.decode_sum([_as_numpy(p) for p in payloads], expected_shape)
        out = torch.from_numpy(dense)
        return out if device is None else out.to(device)

    def __repr__(self) -> str:
        return f"TorchPipeline({self.core.get_config()!r})"


def _as_numpy(payload) -> np.ndarray:
    if isinstance(payload, torch.Tensor):
        return payload.detach().cpu().numpy()
    return np.asarray(payload)


def build(config: ConfigLike) -> TorchPipeline:
    """Build a torch pipeline from a config path, dict, core Pipeline or TorchPipeline."""
    if isinstance(config, TorchPipeline):
        return config
    return TorchPipeline(config if isinstance(config, Pipeline) else build_core(config))
