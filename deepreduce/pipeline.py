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

from . import bitpack, container, kernels, parallel, registry
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
        threads: threads of the C++ kernels (a positive int, or "auto": this host's usable CPUs
            divided by its ranks; see ``deepreduce.parallel``); never changes a byte.
        nonfinite: ``"propagate"`` sends a tensor holding NaN/Inf dense and unchanged, so the
            receiver (and an AMP loss scaler) sees it; ``"raise"`` refuses it with
            NonFiniteGradientError.
    """

    def __init__(self, sparsifier: Sparsifier, index: IndexCodec, value: ValueCodec, memory: Memory,
                 communicator=None, min_numel: int = DEFAULT_MIN_NUMEL, nonfinite: str = "propagate",
                 threads: parallel.ThreadsOption = parallel.AUTO) -> None:
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ConfigError(f"pipeline: 'min_numel' must be a non-negative integer, got {min_numel!r}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ConfigError(f"pipeline: 'nonfinite' is {nonfinite!r}; allowed: {', '.join(NONFINITE_POLICIES)}")
        self.sparsifier = sparsifier
        self.index = index
        self.value = value
        self.value.reorder_is_free = bool(index.keeps_order)
        self.memory = memory
        self.communicator = communicator
        self.min_numel = min_numel
        self.nonfinite = nonfinite
        self.threads_option = parallel.check_threads(threads, "pipeline")
        self.threads = parallel.resolve_threads(self.threads_option)
        for component in (sparsifier, index, value):
            component.threads = self.threads
        self.stats = CompressionStats()
        wire_config = self.get_config()
        wire_config.pop("communicator", None)
        wire_config.pop("threads")  # threads never change a byte
        self._digest = config_digest(wire_config)
        self._decoders = {("index", index.wire_id): index, ("value", value.wire_id): value}
        self._journal = None     # a StepJournal once collective_steps() is on

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
            "threads": self.threads_option,
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

    # ------------------------------------------------------------------ steps decided by every rank
    def collective_steps(self) -> None:
        """Let the ranks decide together whether a step is applied (the distributed integrations
        turn this on; see :mod:`deepreduce.agreement`).

        Under ``nonfinite: raise``, :meth:`encode` then packs a non-finite gradient in the
        flagged dense container instead of raising, so it reaches every rank and every rank
        raises the same error; and each step's changes to the residuals and learned state are
        kept until :meth:`commit_step` (the step was applied) or :meth:`undo_step` (skipped).
        """
        if self._journal is None and self.nonfinite == "raise":
            from .agreement import StepJournal

            self._journal = StepJournal(self)

    def commit_step(self) -> None:
        """Every rank applied the step: its changes stay (no-op unless :meth:`collective_steps`)."""
        if self._journal is not None:
            self._journal.commit()

    def undo_step(self) -> None:
        """Every rank skipped the step: restore the residuals and learned state from before it."""
        if self._journal is not None:
            self._journal.undo()

    # ------------------------------------------------------------------ encode
    def encode(self, grad, name: str = "", step: int = 0, select=None) -> np.ndarray:
        """Compress one gradient into a container (1-D uint8 array).

        ``select(compensated, ctx) -> ascending int64 positions`` replaces the sparsifier's own
        NumPy selection; framework bindings pass their native implementation of the same
        sparsifier (it must choose the same positions).

        With error feedback, the memory's residual absorbs the gradient in place and is what
        the sparsifier reads; after encoding, what the receiver reconstructs (the value codec's
        by-product) is taken out of it at the positions it lands on.
        """
        start = time.perf_counter()
        flat, shape = _as_float32(grad, name)
        sparse = flat.size >= self.min_numel
        # a sparsifier class that defines fused_count has its selection done by the compensation pass
        fused = sparse and select is None and hasattr(type(self.sparsifier), "fused_count")
        if self._journal is not None:
            self._journal.save(name)
        comp = self.memory.accumulate(name, flat, self.sparsifier.fused_count(flat.size) if fused else 0,
                                      self.threads)
        if not comp.finite:
            if self.nonfinite == "raise" and self._journal is None:
                nan, inf = int(np.isnan(flat).sum()), int(np.isinf(flat).sum())
                raise NonFiniteGradientError(
                    f"gradient {name!r} at step {step} has {nan} NaN and {inf} Inf entries "
                    "(pipeline option nonfinite='raise')"
                )
            c = _dense_container(flat, shape, container.FLAG_DENSE | container.FLAG_NONFINITE)
        elif not sparse:
            c = _dense_container(comp.flat, shape, container.FLAG_DENSE)
            self.memory.settle(name, None, None)
        else:
            c, positions, received = self._encode_sparse(comp, shape, self.context(name, step), select)
            self.memory.settle(name, positions, received, self.threads)
        c.digest = self._digest[:container.DIGEST_SIZE]   # receivers compare it with their own config
        payload = container.pack(c)
        self._count_encode(c, payload.size, flat.size, time.perf_counter() - start)
        return payload

    def _select(self, comp, ctx: EncodeContext, select) -> np.ndarray:
        if select is not None:
            return select(comp.flat, ctx)
        if comp.selected is not None:  # selected by the compensation pass (``fused_count``)
            return comp.selected
        return self.sparsifier.select(comp.flat, ctx)

    def _encode_sparse(self, comp, shape, ctx: EncodeContext, select=None):
        """(container, positions, the receiver's values at those positions)."""
        compensated = comp.flat
        indices = self._select(comp, ctx, select)
        values = compensated[indices]
        perm_width, perm_section = 0, b""
        if self.index.keeps_order:
            venc = self.value.encode(values, ctx)
            positions = indices
            if venc.order is not None:
                indices = indices[venc.order]
            ienc = self.index.encode(indices, values if venc.order is None else values[venc.order], compensated, ctx)
        else:
            ienc = self.index.encode(indices, values, compensated, ctx)
            venc = self.value.encode(ienc.values, ctx)
            positions = ienc.indices
            if venc.order is not None and len(ienc.indices):
                perm_width = bitpack.width_for(len(ienc.indices) - 1)
                perm_section = bitpack.pack(venc.order, perm_width)
        received = self.value.reconstruct(venc, len(positions))
        c = container.Container(
            shape=shape, n=len(ienc.indices), index_id=self.index.wire_id, value_id=self.value.wire_id,
            flags=container.FLAG_PERMUTED if perm_width else 0, perm_width=perm_width,
            index_params=ienc.params, value_params=venc.params,
            index_section=ienc.payload, value_section=venc.payload, perm_section=perm_section,
        )
        return c, positions, received

    # ------------------------------------------------------------------ decode
    def decode(self, payload, expected_shape: Optional[Sequence[int]] = None,
               out: Optional[np.ndarray] = None) -> np.ndarray:
        """Reconstruct the dense float32 tensor a container describes.

        ``expected_shape`` (optional) is checked against the header, so a rank that sent a
        tensor of another shape under the same name is reported, not silently mis-summed.
        ``out`` (optional): a C-contiguous float32 array of the tensor's size to write into
        (overwritten); otherwise a fresh array is returned.
        """
        start = time.perf_counter()
        c = self._unpack(payload, expected_shape)
        target = _output(out, c)
        self._decode_into(c, target, accumulate=out is None)  # a fresh buffer is all zeros
        self.stats.tensors_decoded += 1
        self.stats.decode_seconds += time.perf_counter() - start
        return target.reshape(c.shape)

    def decode_sum(self, payloads: Sequence, expected_shape: Optional[Sequence[int]] = None,
                   out: Optional[np.ndarray] = None) -> np.ndarray:
        """Sum of the tensors in several containers (one per rank), checked for equal shapes.

        Every container is decoded straight into one float32 buffer (``out``, overwritten, or a
        fresh array): sparse containers are scatter-added, dense ones added in place, so no
        per-rank dense tensor is ever allocated.
        """
        if len(payloads) == 0:
            raise CommunicationError("no containers to decode")
        target = None
        for rank, payload in enumerate(payloads):
            start = time.perf_counter()
            try:
                c = self._unpack(payload, expected_shape)
                if target is None:
                    target, expected_shape = _output(out, c), c.shape
                self._decode_into(c, target, accumulate=rank > 0 or out is None)
            except DeepReduceError as exc:
                raise type(exc)(f"rank {rank}: {exc}") from exc
            self.stats.tensors_decoded += 1
            self.stats.decode_seconds += time.perf_counter() - start
        return target.reshape(expected_shape)

    def _unpack(self, payload, expected_shape) -> container.Container:
        c = container.unpack(payload)
        if expected_shape is not None and tuple(expected_shape) != c.shape:
            raise CommunicationError(
                f"container holds a tensor of shape {c.shape}, expected {tuple(expected_shape)}: "
                "ranks disagree about this tensor"
            )
        return c

    def _codec(self, kind: str, wire_id: int):
        key = (kind, wire_id)
        codec = self._decoders.get(key)
        if codec is None:
            codec = self._decoders[key] = registry.by_wire_id(kind, wire_id)()
            codec.threads = self.threads
        return codec

    def _decode_into(self, c: container.Container, out: np.ndarray, accumulate: bool) -> None:
        """Add (``accumulate``) or write the container's tensor into the flat float32 ``out``
        (adding into a fresh all-zero buffer spares a pass that would zero it again).

        Validity checks cost O(n): index bounds, and distinct indices (strictly ascending where
        the index codec decodes to the ascending set, else on a sorted copy of the n indices).
        """
        if c.dense:
            dense = np.frombuffer(c.value_section, dtype="<f4")
            if accumulate:
                np.add(out, dense, out=out)
            else:
                out[:] = dense
            return
        index_codec = self._codec("index", c.index_id)
        try:
            indices = index_codec.decode(c.index_params, c.index_section, c.n, c.numel)
            values = self._codec("value", c.value_id).decode(c.value_params, c.value_section, c.n)
        except DeepReduceError:
            raise
        except (ValueError, IndexError, OverflowError) as exc:
            raise ContainerError(f"container sections could not be decoded: {exc}") from exc
        if len(indices) != c.n or len(values) != c.n:
            raise ContainerError(
                f"container decoded to {len(indices)} indices and {len(values)} values, header says {c.n}"
            )
        if c.permuted:  # value j belongs to indices[perm[j]]: put the values in index order
            perm = bitpack.unpack(c.perm_section, c.perm_width, c.n).astype(np.int64)
            if c.n and (perm.max() >= c.n or np.bincount(perm, minlength=c.n).max() != 1):
                raise ContainerError("container permutation section is not a permutation")
            in_index_order = np.empty(c.n, dtype=np.float32)
            in_index_order[perm] = values
            values = in_index_order
        if not accumulate:
            out.fill(0.0)
        kernels.scatter_add(out, indices, values, not index_codec.keeps_order, self.threads)

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


def _output(out: Optional[np.ndarray], c: container.Container) -> np.ndarray:
    """The flat float32 buffer a decode writes: ``out`` (checked, used in place) or fresh zeros
    (pages the OS hands out zeroed; only those the scatter touches are ever written)."""
    if out is None:
        return np.zeros(c.numel, dtype=np.float32)
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or not out.flags.c_contiguous \
            or not out.flags.writeable:
        raise DeepReduceError("decode: out= must be a writeable C-contiguous float32 NumPy array")
    if out.size != c.numel:
        raise CommunicationError(f"decode: out= has {out.size} elements, the container's tensor {c.numel}")
    return out.reshape(-1)


def _dense_container(flat: np.ndarray, shape, flags: int) -> container.Container:
    return container.Container(
        shape=shape, n=flat.size, index_id=0, value_id=0, flags=flags,
        value_section=flat.astype("<f4").tobytes(),
    )
