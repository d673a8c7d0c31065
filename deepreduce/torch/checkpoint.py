"""deepreduce state in a form ``torch.save`` / ``torch.load(weights_only=True)`` accept.

The core keeps its learned state (residuals, stage counts) as NumPy arrays; a PyTorch checkpoint
holds tensors. ``to_torch`` / ``to_numpy`` convert nested dicts/lists between the two, leaving
every other value as it is; ``compression_state_dict`` / ``load_compression_state_dict`` are the
part of a checkpoint that the DDP hook state and the DistributedOptimizer share (its layout and
checks: deepreduce/checkpoint.py).
"""
from __future__ import annotations

import numpy as np
import torch

from .. import checkpoint
from ..errors import ConfigError


def to_torch(value):
    """``value`` with every NumPy array (and NumPy scalar) replaced by a tensor (or Python number)."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value, copy=True))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {key: to_torch(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_torch(item) for item in value)
    return value


def to_numpy(value):
    """Inverse of :func:`to_torch`: every tensor becomes a NumPy array (on the CPU)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {key: to_numpy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_numpy(item) for item in value)
    return value


def compression_state_dict(pipeline, compressor, step: int, aggregation=None) -> dict:
    """``{"format", "step", "compression"}``: a step counter and what the pipeline (residuals,
    adaptive state) or summable compressor (e.g. GradiVeQ models) learned, as tensors; plus
    ``"aggregation"`` (the sparse all-reduce's owner residuals and shard bounds) when given."""
    if pipeline is not None:
        learned = to_torch(pipeline.core.state_dict())
    else:
        learned = compressor.state_dict() if hasattr(compressor, "state_dict") else {}
    return checkpoint.state(step, learned, None if aggregation is None else to_torch(aggregation))


def load_compression_state_dict(pipeline, compressor, state, owner: str, aggregation=None) -> int:
    """Restore :func:`compression_state_dict`'s output; return its step. Errors name ``owner``.
    ``aggregation``: the sparse all-reduce whose state the checkpoint must hold."""
    step = checkpoint.checked_step(state, owner, aggregation is not None)
    if aggregation is not None:   # checked first, applied last: a refused checkpoint changes nothing
        owned = checkpoint.checked_aggregation(owner, to_numpy(state["aggregation"]), aggregation.communicator.size)
    if pipeline is not None:
        pipeline.core.load_state_dict(to_numpy(state["compression"]))
    elif hasattr(compressor, "load_state_dict"):
        compressor.load_state_dict(state["compression"])
    elif state["compression"]:
        raise ConfigError(f"{owner}.load_state_dict: {compressor!r} keeps no state, but the checkpoint holds some")
    if aggregation is not None:
        aggregation.load_state_dict(owned)
    return step
