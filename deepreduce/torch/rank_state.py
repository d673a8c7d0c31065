"""A rank's own state as one value of a ``torch.distributed.checkpoint`` (DCP) checkpoint.

DCP merges the keys every rank saves and keeps one copy of a value saved under the same key by
several ranks (it takes such values to be replicated). Compressor and outer-loop state is per rank
(residuals of this rank's gradients, the global copy of this rank's shard) and does not reshard, so
each rank saves it under a key of its own, ``rank<r>``, as the ``bytes`` of a ``torch.save`` of
plain tensors, numbers and strings, which DCP saves and loads whole and
``torch.load(weights_only=True)`` reads back. Used by :mod:`deepreduce.torch.fsdp_checkpoint` (the
FSDP comms) and :mod:`deepreduce.torch.diloco_dcp` (the outer loop).
"""
from __future__ import annotations

import io

import torch

from ..errors import ConfigError, quote


def rank_key(rank: int) -> str:
    """The key of ``rank``'s state."""
    return f"rank{rank}"


def packed(blob: dict) -> bytes:
    """``blob`` as the bytes DCP saves for this rank."""
    buffer = io.BytesIO()
    torch.save(blob, buffer)
    return buffer.getvalue()


def mine(owner: str, state, rank: int):
    """``state``'s value under this rank's key, where ``state`` holds exactly ``meta`` and that key
    (what the Stateful's ``state_dict()`` returned on this rank); a ConfigError names what differs."""
    key = rank_key(rank)
    if not isinstance(state, dict) or set(state) != {"meta", key}:
        got = sorted(map(str, state))[:8] if isinstance(state, dict) else type(state).__name__
        raise ConfigError(f"{owner}: expected the keys ['meta', {key!r}] (what the state_dict() of this "
                          f"checkpoint's Stateful returns on rank {rank}), got {quote(got)}")
    return state[key]


def unpacked(owner: str, value, rank: int) -> dict:
    """What :func:`packed` wrote, read back with ``weights_only=True``; bytes that are not such a
    dict are a ConfigError naming the rank."""
    if not isinstance(value, (bytes, bytearray)):
        raise ConfigError(f"{owner}: the state of rank {rank} must be bytes, got {type(value).__name__}")
    try:
        blob = torch.load(io.BytesIO(bytes(value)), weights_only=True)
    except Exception as exc:   # noqa: BLE001 (whatever the unpickler raised: the bytes are not a state)
        raise ConfigError(f"{owner}: the state of rank {rank} does not read back ({type(exc).__name__}: "
                          f"{exc})") from None
    if not isinstance(blob, dict):
        raise ConfigError(f"{owner}: the state of rank {rank} must be a dict, got {type(blob).__name__}")
    return blob
