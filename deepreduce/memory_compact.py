"""Compact error feedback: the residual kept as int8 codes with one float32 scale per block.

A float32 residual costs 4 bytes per element of the tensor it compensates, as much as the
gradient itself; under FSDP the rank's gradient shard is the budget of everything the compressor
keeps (issue 32). LoCo (Xie et al., 2024; the ZeRO++-style compact error of low-bit communication)
keeps the compensation error in 8 bits. :class:`CompactResidualMemory` (``compact_residual``) does
that with deepreduce's stages:

* ``accumulate``: the stored residual is decoded (``code * scale``, float32) into a working buffer
  of the tensor's size, the gradient is added to it (the same one-pass scan as
  :class:`~deepreduce.memory.ResidualMemory`, which refuses a non-finite gradient and leaves the
  stored residual as it was), and the sparsifier reads that buffer;
* ``settle``: what the receivers reconstruct is taken out of the working buffer, which is then
  quantised again (:func:`quantise`) and dropped: between steps only ``numel`` int8 codes and
  ``ceil(numel / block)`` float32 scales are kept, ``1 + 4 / block`` bytes per element (1.0625
  at the default block of 64: 0.27 of a float32 residual).

Quantisation is deterministic: per block of ``block`` consecutive elements, ``scale =
fl32(max|x| / 127)`` and ``code = clip(rint(x / scale), -127, 127)`` (an all-zero block has scale 0
and codes 0), so each element is kept to within half a step, ``|x - code * scale| <= max|x| /
254`` (plus float32 rounding): :func:`quantise` and :func:`dequantise` are the one definition.
A block holding NaN/Inf (a compensation that overflowed float32; the pipeline sends such a
tensor dense and flagged) is stored as zeros: that block's residual starts again.

``average`` (LoCo's moving average of the compensation error, ``beta``): the stored residual
becomes ``(1 - beta) e_{t-1} + beta (c_t - s_t)`` instead of ``c_t - s_t`` (``c_t = decay e_{t-1}
+ g_t`` the compensated gradient, ``s_t`` what the receivers reconstruct). ``decay`` (SparseLoCo's
decayed error feedback, as ``decayed_residual``) scales the residual before the gradient is added.
``beta = decay = 1`` is plain error feedback, where conservation holds up to the quantisation:
per element after ``T`` steps ``|sum_t s_t + e_T - sum_t g_t| <= sum_t q_t`` with ``q_t`` the
step's half quantisation step (with ``decay``: ``sum_t decay**(T-t) (g_t - s_t)`` against
``e_T``; tests/test_memory_compact.py checks both).

The journal's snapshot is free: a settle replaces a tensor's codes and scales with new arrays
and never changes them in place, so the stored pair itself is the snapshot.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import numpy as np

from . import checkpoint
from .backend import arrays, kernels
from .errors import CommunicationError, ConfigError, DeepReduceError
from .memory import Compensated, Memory, residual_entries, union_sum
from .params import Param
from .registry import register

#: Largest code magnitude: codes are symmetric int8, -127 ... 127.
LEVELS = 127


class CompactResidual(NamedTuple):
    """A tensor's residual: ``numel`` int8 ``codes`` and one float32 ``scale`` per ``block``."""

    codes: np.ndarray
    scales: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.scales.nbytes)


def blocks(numel: int, block: int) -> int:
    """The number of scales of a tensor of ``numel`` elements: ``ceil(numel / block)``."""
    return -(-numel // block)


def quantise(flat: np.ndarray, block: int) -> CompactResidual:
    """The float32 ``flat`` as int8 codes and one float32 scale per ``block`` elements (the last
    block may be shorter); a block holding NaN/Inf is stored as zeros."""
    flat = np.asarray(flat, dtype=np.float32)
    numel, count = flat.shape[0], blocks(flat.shape[0], block)
    padded = np.zeros(count * block, dtype=np.float32)
    padded[:numel] = flat
    rows = padded.reshape(count, block)
    with np.errstate(invalid="ignore", over="ignore"):
        peak = np.max(np.abs(rows), axis=1) if count else np.zeros(0, np.float32)
    finite = np.isfinite(peak)
    scales = np.where(finite, peak / np.float32(LEVELS), np.float32(0)).astype(np.float32)
    scaled = np.zeros_like(rows)
    live = scales > 0
    np.divide(rows, scales[:, None], out=scaled, where=live[:, None])
    codes = np.clip(np.rint(scaled), -LEVELS, LEVELS).astype(np.int8).reshape(-1)[:numel]
    return CompactResidual(codes, scales)


def dequantise(held: CompactResidual, block: int) -> np.ndarray:
    """The float32 residual the codes stand for: ``code * scale`` of its block (a new array)."""
    out = held.codes.astype(np.float32)
    if out.shape[0]:
        out *= np.repeat(held.scales, block)[:out.shape[0]]
    return out


@register
class CompactResidualMemory(Memory):
    """Error feedback with an 8-bit residual: int8 codes and a float32 scale per ``block``."""

    id = "compact_residual"
    stateful = True
    PARAMS = {"block": Param(int, default=64, low=1, high=1 << 20, doc="elements per float32 scale"),
              "average": Param(float, default=1.0, low=0.0, high=1.0, low_open=True,
                               doc="LoCo's weight beta of the newest error: e <- (1 - beta) e + beta (c - s)"),
              "decay": Param(float, default=1.0, low=0.0, high=1.0, low_open=True,
                             doc="factor applied to the residual before each gradient is added: c = decay e + g")}

    def _init_state(self) -> None:
        self._held: Dict[str, CompactResidual] = {}
        # name -> (working buffer between accumulate and settle, the decoded residual before it
        # when average < 1): the float32 tensor the sparsifier reads, dropped at settle
        self._open: Dict[str, Tuple[object, Optional[np.ndarray]]] = {}

    def _decoded(self, name: str, numel: int, decayed: bool = False) -> Optional[np.ndarray]:
        """``name``'s stored residual decoded (host float32; ``decayed``: times ``decay``), None
        before its first step; a CommunicationError when the tensor changed size."""
        held = self._held.get(name)
        if held is None:
            return None
        if held.codes.shape[0] != numel:
            raise CommunicationError(f"compact residual memory: tensor {name!r} had {held.codes.shape[0]} elements, "
                                     f"now {numel}; a name must keep its size")
        out = dequantise(held, self.block)
        if decayed and self.decay != 1.0:
            out *= np.float32(self.decay)
        return out

    def _working(self, name: str, flat):
        """A float32 buffer holding the decoded residual (zeros before the first step), in
        ``flat``'s framework and device; and the decoded residual when ``average < 1``."""
        decoded = self._decoded(name, flat.shape[0], decayed=True)
        host = np.zeros(flat.shape[0], np.float32) if decoded is None else decoded
        previous = self._decoded(name, flat.shape[0]) if self.average != 1.0 else None
        working = arrays.adapter(flat).from_numpy(host, flat) if arrays.is_torch(flat) else host
        return working, previous

    def accumulate(self, name, flat, topk=0, threads=1):
        working, previous = self._working(name, flat)
        finite, selected = kernels.scan(flat, working, topk, threads)
        if not finite:   # the stored residual is untouched; the working buffer is dropped
            return Compensated(flat, False)
        self._open[name] = (working, previous)
        return Compensated(working, True, selected)

    def compensate(self, name, flat):
        decoded = self._decoded(name, flat.shape[0], decayed=True)
        if decoded is None:
            xp = arrays.namespace(flat)
            return xp.asarray(flat, dtype=xp.float32, copy=True)
        if arrays.is_torch(flat):
            return arrays.adapter(flat).from_numpy(decoded, flat) + flat
        return decoded + flat

    def settle(self, name, positions, values, threads=1):
        if name not in self._open:
            raise DeepReduceError(f"compact residual memory: tensor {name!r} settled without being accumulated")
        working, previous = self._open.pop(name)
        if positions is None:
            working[...] = 0.0
        elif len(positions):
            kernels.subtract_at(working, positions, values, threads)
        self._store(name, _host(working), previous)

    def _store(self, name: str, error: np.ndarray, previous: Optional[np.ndarray]) -> None:
        """Keep ``error`` (host float32, the compensated gradient minus what was reconstructed),
        averaged with ``previous`` when ``average < 1``, as new codes and scales."""
        if previous is not None:
            beta = np.float32(self.average)
            error = (np.float32(1) - beta) * previous + beta * error
        self._held[name] = quantise(error, self.block)

    def accumulate_entries(self, name: str, positions: np.ndarray, values: np.ndarray,
                           numel: int) -> Tuple[np.ndarray, np.ndarray]:
        """A gradient given by its entries, compensated: the union of its entries and the stored
        residual's non-zeros (the residual is dense in codes; see ``ResidualMemory``'s)."""
        decoded = self._decoded(name, int(numel), decayed=True)
        self._open[name] = (None, self._decoded(name, int(numel)) if self.average != 1.0 else None)
        if decoded is None:
            return np.asarray(positions, np.int64), np.array(values, dtype=np.float32, copy=True)
        held = np.flatnonzero(decoded)
        return union_sum(held, decoded[held], positions, values)

    def settle_entries(self, name: str, positions: np.ndarray, compensated: np.ndarray, sent: np.ndarray,
                       received: np.ndarray, numel: int) -> None:
        """The residual after sending entries: the compensated entries minus what the receivers
        reconstruct at the distinct ``sent`` positions, quantised; ``sent=None``: all sent exactly."""
        _, previous = self._open.pop(name, (None, None))
        error = np.zeros(int(numel), dtype=np.float32)
        if sent is not None:
            error[np.asarray(positions, np.int64)] = compensated
            sent = np.asarray(sent, np.int64)
            error[sent] -= np.asarray(received, np.float32)
        self._store(name, error, previous)

    def residual(self, name: str) -> Optional[np.ndarray]:
        """The residual held for ``name``, decoded to float32 (a new array: changing it does not
        change the memory); None before its first step."""
        held = self._held.get(name)
        return None if held is None else dequantise(held, self.block)

    def take(self, name: str) -> Optional[np.ndarray]:
        held = self._held.get(name)
        if held is None or not held.codes.any():
            return None
        self._held[name] = CompactResidual(np.zeros_like(held.codes), np.zeros_like(held.scales))
        return dequantise(held, self.block)

    def hold(self, name: str, residual: np.ndarray) -> None:
        """Keep ``residual`` (float32) as ``name``'s, quantised."""
        self._held[name] = quantise(_host(residual), self.block)

    def reset(self):
        self._held.clear()
        self._open.clear()

    def snapshot(self, name):
        return self._held.get(name)   # never changed in place: the pair is its own copy

    def restore(self, name, snapshot):
        self._open.pop(name, None)
        if snapshot is None:
            self._held.pop(name, None)
        else:
            self._held[name] = snapshot

    def nbytes(self) -> int:
        """Bytes held between steps: every tensor's codes and scales."""
        return sum(held.nbytes for held in self._held.values())

    def state_dict(self) -> dict:
        """``{"residuals": {name: {"codes": int8 array, "scales": float32 array}}}`` (copies)."""
        return {"residuals": {name: {"codes": held.codes.copy(), "scales": held.scales.copy()}
                              for name, held in self._held.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Replace every residual with the checkpoint's, checked whole first: codes in
        ``[-127, 127]``, ``ceil(numel / block)`` finite non-negative scales."""
        owner = f"memory {self.id!r}"
        loaded = {}
        for name, entry in residual_entries(owner, state, "{'codes', 'scales'}"):
            entry = checkpoint.checked_keys(f"{owner} residual {name!r}", entry, ("codes", "scales"))
            codes = checkpoint.checked_array(owner, f"residual {name!r} codes", entry["codes"], "int")
            if codes.size and (codes.min() < -LEVELS or codes.max() > LEVELS):
                raise ConfigError(f"{owner}: residual {name!r} codes must lie in [-{LEVELS}, {LEVELS}]")
            scales = checkpoint.checked_array(owner, f"residual {name!r} scales", entry["scales"], "float",
                                              length=blocks(codes.shape[0], self.block))
            if scales.size and scales.min() < 0:
                raise ConfigError(f"{owner}: residual {name!r} scales must not be negative")
            loaded[name] = CompactResidual(codes.astype(np.int8), scales)
        self.reset()
        self._held.update(loaded)


def _host(residual) -> np.ndarray:
    """A float32 buffer as a host NumPy array (a torch tensor is copied to the host)."""
    return np.asarray(arrays.adapter(residual).to_numpy(residual), dtype=np.float32)
