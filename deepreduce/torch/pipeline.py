"""The PyTorch face of a pipeline: torch tensors in, the core's exact bytes out.

Encoding hands the gradient to the framework-neutral core, so the container is byte-identical
to ``deepreduce.build(config).encode`` for the same input, name and step.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from ..config import ConfigLike, build as build_core
from ..pipeline import Pipeline, dtype_error
from .sparsify import select_torch


class TorchPipeline:
    """Wraps a core :class:`~deepreduce.Pipeline` for torch tensors.

    ``encode(tensor, name=, step=)`` returns a 1-D ``torch.uint8`` CPU tensor; ``decode(payload)``
    returns a float32 tensor of the original shape (on ``device``, default CPU, or in ``out=``);
    ``decode_sum(payloads, out=)`` sums every rank's container into one tensor.
    """

    def __init__(self, core: Pipeline) -> None:
        self.core = core

    @property
    def stats(self):
        return self.core.stats

    def get_config(self) -> dict:
        return self.core.get_config()

    def encode(self, tensor: torch.Tensor, name: str = "", step: int = 0) -> torch.Tensor:
        """Encode ``tensor`` exactly as the core does; returns the container as a uint8 CPU tensor.

        A CPU tensor is handed to the core as a zero-copy NumPy view (a float32 contiguous
        gradient is never copied), so the core's C++ kernels do the compensation and the
        selection. On another device the sparsifier runs as torch code on the device (the same
        positions, ``deepreduce.torch.sparsify``) and the codecs run on the CPU copy (they need
        the dense values, e.g. Bloom P0); with error feedback the selection reads the
        compensated gradient the core keeps. The container keeps the tensor's shape (a 0-d
        tensor decodes as 0-d); an integer tensor is refused with the core's message; a sparse
        tensor is coalesced and encoded as its dense form.
        """
        grad = _dense_float(tensor.detach(), name)
        if grad.device.type == "cpu":
            return torch.from_numpy(self.core.encode(_numpy_view(grad), name=name, step=int(step)))
        flat_device = (grad if grad.dtype == torch.float32 else grad.float()).reshape(-1)
        stateless = not self.core.memory.stateful

        def select(compensated: np.ndarray, ctx) -> np.ndarray:
            source = flat_device if stateless else torch.from_numpy(compensated).to(flat_device.device)
            return select_torch(self.core.sparsifier, source, ctx).cpu().numpy()

        host = grad.cpu() if grad.dtype == torch.float64 else flat_device.cpu().reshape(grad.shape)
        payload = self.core.encode(_numpy_view(host), name=name, step=int(step), select=select)
        return torch.from_numpy(payload)

    def decode(self, payload, expected_shape: Optional[Sequence[int]] = None,
               device: Optional[torch.device] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The tensor a container describes: in ``out`` (written in place) or a new tensor on ``device``."""
        return self._into(out, device, lambda buf: self.core.decode(_as_numpy(payload), expected_shape, out=buf))

    def decode_sum(self, payloads, expected_shape: Optional[Sequence[int]] = None,
                   device: Optional[torch.device] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Sum of every rank's container, decoded straight into one buffer.

        ``out`` (e.g. a parameter's ``.grad``) is overwritten with the sum; a float32 contiguous
        CPU tensor is written in place through its NumPy view, any other is filled by one copy.
        """
        arrays = [_as_numpy(p) for p in payloads]
        return self._into(out, device, lambda buf: self.core.decode_sum(arrays, expected_shape, out=buf))

    @staticmethod
    def _into(out: Optional[torch.Tensor], device, decode) -> torch.Tensor:
        if out is None:
            result = torch.from_numpy(decode(None))
            return result if device is None else result.to(device)
        if out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous():
            decode(out.detach().numpy().reshape(-1))
            return out
        with torch.no_grad():
            out.copy_(torch.from_numpy(decode(None)).reshape(out.shape))
        return out

    def __repr__(self) -> str:
        return f"TorchPipeline({self.core.get_config()!r})"


def _dense_float(grad: torch.Tensor, name: str) -> torch.Tensor:
    """A floating-point gradient as a strided tensor: sparse layouts are coalesced and made dense
    (the pipeline selects from the dense gradient); other dtypes are refused as by the core."""
    if not grad.is_floating_point():
        raise dtype_error(name, grad.dtype)
    if grad.layout == torch.sparse_coo:
        return grad.coalesce().to_dense()
    return grad.to_dense() if grad.layout != torch.strided else grad


def _numpy_view(grad: torch.Tensor) -> np.ndarray:
    """A CPU tensor as float32 NumPy without a copy when it already is float32 and contiguous
    (a float64 one goes through the core's checked conversion: overflow is reported)."""
    if grad.dtype not in (torch.float32, torch.float64):
        grad = grad.float()
    return grad.contiguous().numpy()


def _as_numpy(payload) -> np.ndarray:
    if isinstance(payload, torch.Tensor):
        return payload.detach().cpu().numpy()
    return np.asarray(payload)


def build(config: ConfigLike) -> TorchPipeline:
    """Build a torch pipeline from a config path, dict, core Pipeline or TorchPipeline."""
    if isinstance(config, TorchPipeline):
        return config
    return TorchPipeline(config if isinstance(config, Pipeline) else build_core(config))
