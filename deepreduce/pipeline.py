"""DeepReduce = memory + sparsifier + index codec + value codec (+ reorder), one container out.

Encode: compensate with the error-feedback residual, select entries, let the index codec
choose and compress the positions, let the value codec compress the values, carry a
permutation when the value codec reorders and the index codec cannot follow, pack one
container. Decode reads everything it needs from the container header, so any rank decodes
any rank's payload.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np

from . import bitpack, container, registry
from .errors import (
    CommunicationError, ConfigError, ContainerError, DeepReduceError, NonFiniteGradientError,
)
from .index import IndexCodec
from .memory import Memory
from .seeding import EncodeContext, config_digest
from .sparsify import Sparsifier
from .stats import CompressionStats
from .values import ValueCodec

NONFINITE_POLICIES = ("propagate", "raise")
_STATEFUL_PARTS = ("sparsifier", "index", "value", "memory")
DEFAULT_MIN_NUMEL = 1000


class Pipeline:
    """One configured DeepReduce instance; holds per-tensor state (residuals) and statistics.

    Args:
        sparsifier, index, value, memory: built components (see ``deepreduce.build``).
        communicator: optional communicator component used by the training integrations.
        min_numel: tensors with fewer elements travel dense (float32) in the container.
        nonfinite: ``"propagate"`` sends a tensor holding NaN/Inf dense and unchanged, so the
            receiver (and an AMP loss scaler) sees it; ``"raise"`` refuses it with
            NonFiniteGradientError.
    """

    def __init__(self, sparsifier: Sparsifier, index: IndexCodec, value: ValueCodec, memory: Memory,
                 communicator=None, min_numel: int = DEFAULT_MIN_NUMEL, nonfinite: str = "propagate") -> None:
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ConfigError(f"pipeline: 'min_numel' must be a non-negative integer, got {min_numel!r}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ConfigError(f"pipeline: 'nonfinite' is {nonfinite!r}; allowed: {', '.join(NONFINITE_POLICIES)}")
        self.sparsifier = sparsifier
        self.index = index
        self.value = value
        self.memory = memory
        self.communicator = communicator
        self.min_numel = min_numel
        self.nonfinite = nonfinite
        self.stats = CompressionStats()
        wire_config = self.get_config()
        wire_config.pop("communicator", None)
        self._digest = config_digest(wire_config)
        self._decoders = {("index", index.wire_id): index, ("value", value.wire_id): value}

    # ------------------------------------------------------------------ config
    def get_config(self) -> dict:
        """The config dict that rebuilds an equal pipeline with ``deepreduce.build``."""
        config = {
            "sparsifier": self.sparsifier.get_config(),
            "index": self.index.get_config(),
            "value": self.value.get_config(),
            "memory": self.memory.get_config(),
            "min_numel": self.min_numel,
            "nonfinite": self.nonfinite,
        }
        if self.communicator is not None:
            config["communicator"] = self.communicator.get_config()
        return config

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pipeline) and self.get_config() == other.get_config()

    def __repr__(self) -> str:
        return f"Pipeline({self.get_config()!r})"

    @property
    def config_digest(self) -> bytes:
        """16-byte digest of the wire config (no communicator): equal on ranks that agree."""
        return self._digest

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """What this pipeline learned while encoding: error-feedback residuals and the
        components' adaptive state (e.g. SIDCo stage counts), keyed by component.

        Plain Python values and NumPy arrays; ``load_state_dict`` on a pipeline built from the
        same config makes its next containers byte-identical to this one's.
        """
        return {"config_digest": self._digest.hex(),
                **{kind: getattr(self, kind).state_dict() for kind in _STATEFUL_PARTS}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output; refuses a checkpoint of another config."""
        expected = {"config_digest", *_STATEFUL_PARTS}
        if not isinstance(state, dict) or set(state) != expected:
            got = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise ConfigError(f"pipeline checkpoint must have the keys {sorted(expected)}, got {got}")
        if state["config_digest"] != self._digest.hex():
            raise ConfigError("pipeline checkpoint was saved by a pipeline with another config "
                              f"(digest {state['config_digest']}, this pipeline {self._digest.hex()})")
        for kind in _STATEFUL_PARTS:
            getattr(self, kind).load_state_dict(state[kind])

    def context(self, name: str, step: int) -> EncodeContext:
        """The seeding context for one (tensor, step): the same on every rank."""
        return EncodeContext(self._digest, name, step)

    # ------------------------------------------------------------------ encode
    def encode(self, grad, name: str = "", step: int = 0, select=None) -> np.ndarray:
        """Compress one gradient into a container (1-D uint8 array).

        ``select(compensated, ctx) -> ascending int64 positions`` replaces the sparsifier's own
        NumPy selection; framework bindings pass their native implementation of the same
        sparsifier (it must choose the same positions).
        """
        start = time.perf_counter()
        flat, shape = _as_float32(grad, name)
        finite = bool(np.isfinite(flat).all())
        if not finite:
            if self.nonfinite == "raise":
                nan, inf = int(np.isnan(flat).sum()), int(np.isinf(flat).sum())
                raise NonFiniteGradientError(
                    f"gradient {name!r} at step {step} has {nan} NaN and {inf} Inf entries "
                    "(pipeline option nonfinite='raise')"
                )
            c = _dense_container(flat, shape, container.FLAG_DENSE | container.FLAG_NONFINITE)
        else:
            compensated = self.memory.compensate(name, flat)
            if flat.size < self.min_numel:
                c = _dense_container(compensated, shape, container.FLAG_DENSE)
            else:
                c = self._encode_sparse(compensated, shape, self.context(name, step), select)
            if self.memory.stateful:
                self.memory.update(name, compensated, self._decode(c).ravel())
        payload = container.pack(c)
        self._count_encode(c, payload.size, flat.size, time.perf_counter() - start)
        return payload

    def _encode_sparse(self, compensated: np.ndarray, shape, ctx: EncodeContext, select=None) -> container.Container:
        indices = (select or self.sparsifier.select)(compensated, ctx)
        values = compensated[indices]
        perm_width, perm_section = 0, b""
        if self.index.keeps_order:
            venc = self.value.encode(values, ctx)
            if venc.order is not None:
                indices, values = indices[venc.order], values[venc.order]
            ienc = self.index.encode(indices, values, compensated, ctx)
        else:
            ienc = self.index.encode(indices, values, compensated, ctx)
            venc = self.value.encode(ienc.values, ctx)
            if venc.order is not None and len(ienc.indices):
                perm_width = bitpack.width_for(len(ienc.indices) - 1)
                perm_section = bitpack.pack(venc.order, perm_width)
        return container.Container(
            shape=shape, n=len(ienc.indices), index_id=self.index.wire_id, value_id=self.value.wire_id,
            flags=container.FLAG_PERMUTED if perm_width else 0, perm_width=perm_width,
            index_params=ienc.params, value_params=venc.params,
            index_section=ienc.payload, value_section=venc.payload, perm_section=perm_section,
        )

    # ------------------------------------------------------------------ decode
    def decode(self, payload, expected_shape: Optional[Sequence[int]] = None) -> np.ndarray:
        """Reconstruct the dense float32 tensor a container describes.

        ``expected_shape`` (optional) is checked against the header, so a rank that sent a
        tensor of another shape under the same name is reported, not silently mis-summed.
        """
        start = time.perf_counter()
        c = container.unpack(payload)
        if expected_shape is not None and tuple(expected_shape) != c.shape:
            raise CommunicationError(
                f"container holds a tensor of shape {c.shape}, expected {tuple(expected_shape)}: "
                "ranks disagree about this tensor"
            )
        out = self._decode(c)
        self.stats.tensors_decoded += 1
        self.stats.decode_seconds += time.perf_counter() - start
        return out

    def _codec(self, kind: str, wire_id: int):
        key = (kind, wire_id)
        codec = self._decoders.get(key)
        if codec is None:
            codec = self._decoders[key] = registry.by_wire_id(kind, wire_id)()
        return codec

    def _decode(self, c: container.Container) -> np.ndarray:
        if c.dense:
            return np.frombuffer(c.value_section, dtype="<f4").astype(np.float32).reshape(c.shape)
        try:
            indices = self._codec("index", c.index_id).decode(c.index_params, c.index_section, c.n, c.numel)
            values = self._codec("value", c.value_id).decode(c.value_params, c.value_section, c.n)
        except DeepReduceError:
            raise
        except (ValueError, IndexError, OverflowError) as exc:
            raise ContainerError(f"container sections could not be decoded: {exc}") from exc
        if len(indices) != c.n or len(values) != c.n:
            raise ContainerError(
                f"container decoded to {len(indices)} indices and {len(values)} values, header says {c.n}"
            )
        if c.permuted:
            perm = bitpack.unpack(c.perm_section, c.perm_width, c.n).astype(np.int64)
            if c.n and (perm.max() >= c.n or np.bincount(perm, minlength=c.n).max() != 1):
                raise ContainerError("container permutation section is not a permutation")
            indices = indices[perm]
        out = np.zeros(c.numel, dtype=np.float32)
        if c.n:
            if indices.min() < 0 or indices.max() >= c.numel:
                raise ContainerError(f"container index out of range for a tensor of {c.numel} elements")
            seen = np.zeros(c.numel, dtype=bool)
            seen[indices] = True
            if np.count_nonzero(seen) != c.n:
                raise ContainerError("container repeats an index")
            out[indices] = values
        return out.reshape(c.shape)

    def decode_sum(self, payloads: Sequence, expected_shape: Optional[Sequence[int]] = None) -> np.ndarray:
        """Sum of the tensors in several containers (one per rank), checked for equal shapes."""
        total = None
        for rank, payload in enumerate(payloads):
            try:
                dense = self.decode(payload, expected_shape)
            except DeepReduceError as exc:
                raise type(exc)(f"rank {rank}: {exc}") from exc
            if total is None:
                total, expected_shape = dense.copy(), dense.shape
            else:
                total += dense
        if total is None:
            raise CommunicationError("no containers to decode")
        return total

    # ------------------------------------------------------------------ stats
    def _count_encode(self, c: container.Container, nbytes: int, numel: int, seconds: float) -> None:
        s = self.stats
        s.tensors_encoded += 1
        s.dense_bytes += 4 * numel
        s.wire_bytes += nbytes
        s.index_bytes += len(c.index_section)
        s.value_bytes += len(c.value_section)
        s.permutation_bytes += len(c.perm_section)
        s.header_bytes += nbytes - len(c.index_section) - len(c.value_section) - len(c.perm_section)
        s.encode_seconds += seconds


def _as_float32(grad, name: str):
    """A gradient as a flat float32 array and its shape; rejects non-float input by name."""
    arr = np.asarray(grad)
    if not np.issubdtype(arr.dtype, np.floating):
        raise DeepReduceError(f"gradient {name!r} has dtype {arr.dtype}; deepreduce compresses floating-point tensors")
    return np.ascontiguousarray(arr, dtype=np.float32).ravel(), tuple(int(s) for s in arr.shape)


def _dense_container(flat: np.ndarray, shape, flags: int) -> container.Container:
    return container.Container(
        shape=shape, n=flat.size, index_id=0, value_id=0, flags=flags,
        value_section=flat.astype("<f4").tobytes(),
    )
