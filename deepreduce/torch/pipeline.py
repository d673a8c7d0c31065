"""The PyTorch face of a pipeline: torch tensors in, the core's exact bytes out.

Two paths give the same container bytes as ``deepreduce.build(config).encode`` for the same
input, name and step:

* **host**: the gradient goes to the core as NumPy (a zero-copy view of a CPU tensor), whose
  C++ kernels compress it; the fast path on the CPU.
* **device**: the core runs on the torch tensor itself (its codecs are written against the
  array namespace, ``deepreduce.backend.arrays``): residual, finiteness check, selection, index and
  value codecs and the container assembly stay on the tensor's device, and only the compact
  container crosses to the host (for its CRC). Decoding uploads the compact sections and
  accumulates into a tensor on the device. Components without a device implementation run on
  the host with a one-time warning (``backends()`` lists them).

``path="auto"`` (default) takes the host path for CPU tensors and the device path for others.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from ..config import ConfigLike
from ..config import build as build_core
from ..errors import ConfigError
from ..pipeline import Pipeline, dtype_error, select_positions
from ..wire import container

PATHS = ("auto", "device", "host")


class TorchPipeline:
    """Wraps a core :class:`~deepreduce.Pipeline` for torch tensors.

    ``encode(tensor, name=, step=)`` returns a 1-D ``torch.uint8`` CPU tensor; ``decode(payload)``
    returns a float32 tensor of the original shape (on ``device``, default CPU, or in ``out=``);
    ``decode_sum(payloads, out=)`` sums every rank's container into one tensor.
    """

    def __init__(self, core: Pipeline, path: str = "auto") -> None:
        if path not in PATHS:
            raise ConfigError(f"torch pipeline: path is {path!r}; allowed: {', '.join(PATHS)}")
        self.core = core
        self.path = path

    def on_device(self, device: Optional[torch.device]) -> bool:
        """Whether tensors on ``device`` take the device path."""
        if self.path != "auto":
            return self.path == "device"
        if device is None:
            return False
        return (device if isinstance(device, torch.device) else torch.device(device)).type != "cpu"

    def backends(self, device="cpu") -> dict:
        """Which implementation runs each component for tensors on ``device`` (see
        :func:`deepreduce.pipeline.backends`)."""
        return self.core.backends(device=device if self.on_device(device) else None)

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
        positions: the sparsifiers are written on the array namespace) and the codecs run on the CPU copy (they need
        the dense values, e.g. Bloom P0); with error feedback the selection reads the
        compensated gradient the core keeps. The container keeps the tensor's shape (a 0-d
        tensor decodes as 0-d); an integer tensor is refused with the core's message; a sparse
        tensor is coalesced and encoded as its dense form.
        """
        grad = _dense_float(tensor.detach() if tensor.requires_grad else tensor, name)
        on_device = self._takes_device_path(grad)
        if grad.is_cpu and not on_device:   # the host path
            return torch.from_numpy(self.core.encode(_numpy_view(grad), name=name, step=int(step)))
        if on_device:   # the core on the tensor itself (it selects with torch ops)
            return self.core.encode(grad, name=name, step=int(step))
        flat_device = (grad if grad.dtype == torch.float32 else grad.float()).reshape(-1)
        stateless = not self.core.memory.stateful

        def select(compensated: np.ndarray, ctx) -> np.ndarray:
            source = flat_device if stateless else torch.from_numpy(compensated).to(flat_device.device)
            return select_positions(self.core.sparsifier, source, ctx).cpu().numpy()

        host = grad.cpu() if grad.dtype == torch.float64 else flat_device.cpu().reshape(grad.shape)
        payload = self.core.encode(_numpy_view(host), name=name, step=int(step), select=select)
        return torch.from_numpy(payload)

    def decode(self, payload, expected_shape: Optional[Sequence[int]] = None,
               device: Optional[torch.device] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The tensor a container describes: in ``out`` (written in place) or a new tensor on ``device``."""
        return self.decode_sum([payload], expected_shape, device, out)

    def decode_sum(self, payloads, expected_shape: Optional[Sequence[int]] = None,
                   device: Optional[torch.device] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Sum of every rank's container, decoded straight into one buffer.

        ``out`` (e.g. a parameter's ``.grad``) is overwritten with the sum; a float32 contiguous
        CPU tensor is written in place through its NumPy view, any other is filled by one copy.
        """
        if (self.on_device(device) if out is None else self._takes_device_path(out)) and len(payloads):
            target = device if out is None else out.device
            if out is None:
                shape = container.unpack(payloads[0], expected_shape, self.core.max_numel).shape   # bounded first
                out = torch.empty(shape, dtype=torch.float32, device=target)   # the decode writes all of it
            if out.dtype == torch.float32 and out.is_contiguous():
                self.core.decode_sum(list(payloads), expected_shape, out=out)
                return out
        arrays = [_as_numpy(p) for p in payloads]
        return self._into(out, device, lambda buf: self.core.decode_sum(arrays, expected_shape, out=buf))

    def _takes_device_path(self, tensor: torch.Tensor) -> bool:
        """:meth:`on_device` of ``tensor``'s device (``is_cpu`` is cheaper than ``device.type``)."""
        return not tensor.is_cpu if self.path == "auto" else self.path == "device"

    @staticmethod
    def _into(out: Optional[torch.Tensor], device, decode) -> torch.Tensor:
        if out is None:
            result = torch.from_numpy(decode(None))
            return result if device is None else result.to(device)
        if out.is_cpu and out.dtype == torch.float32 and out.is_contiguous():
            decode((out.detach() if out.requires_grad else out).numpy().reshape(-1))
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
    return (grad if grad.is_contiguous() else grad.contiguous()).numpy()


def _as_numpy(payload) -> np.ndarray:
    """A container (a uint8 tensor, which never requires grad, or array-like) as NumPy."""
    if isinstance(payload, torch.Tensor):
        return (payload if payload.is_cpu else payload.cpu()).numpy()
    return np.asarray(payload)


def build(config: ConfigLike, path: str = "auto") -> TorchPipeline:
    """Build a torch pipeline from a config path, dict, core Pipeline or TorchPipeline
    (``path``: "auto", "device" or "host", see the module docstring)."""
    if isinstance(config, TorchPipeline):
        return config if path == "auto" else TorchPipeline(config.core, path)
    return TorchPipeline(config if isinstance(config, Pipeline) else build_core(config), path)
