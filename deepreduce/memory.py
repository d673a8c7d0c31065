"""Error-feedback memories, keyed by tensor name, living in one pipeline instance.

The pipeline drives a memory in two calls per encoded tensor:

* ``accumulate(name, flat)``: the residual absorbs the gradient in place (``residual +=
  grad``, one pass that also checks finiteness, see ``deepreduce.backend.kernels.scan``); the residual
  buffer now *is* the compensated gradient the sparsifier reads.
* ``settle(name, positions, values)``: after encoding, ``residual[positions] -= values``,
  where ``values`` is what the receiver reconstructs at ``positions`` (value codecs hand it back
  as a by-product of encoding, computed from their ``n`` values; nothing decodes a container on
  the sender). A tensor sent dense is reconstructed exactly, so its residual becomes zero.

Residuals live where the gradient lives: a NumPy array for NumPy gradients, a torch tensor on
the gradient's device for the torch device path (a checkpointed residual moves to the device of
the first gradient it meets). The residual is float32, as in production error-feedback
implementations (a float64 residual would double the optimizer's footprint). Conservation therefore holds to float32 rounding:
with ``c_t = fl(e_{t-1} + g_t)`` the compensated gradient and ``e_t = fl(c_t - s_t)`` the
residual after sending ``s_t``, each step rounds once in each operation, so per element after
``T`` steps::

    |sum_t s_t + e_T - sum_t g_t| <= 2**-24 * sum_t (|c_t| + |e_t|)

(an entry a lossless codec sends exactly leaves ``e_t = 0`` with no rounding at all).
tests/test_memory.py checks this bound over many steps.

A gradient that arrives as entries (a torch sparse COO gradient, a TF ``IndexedSlices``:
``routes.entries.encode_entries``) keeps a sparse residual (:class:`SparseResidual`): compensation is
the union of the gradient's and the residual's entries (:meth:`ResidualMemory.accumulate_entries`)
and the residual afterwards holds only what was not reconstructed, so no dense tensor of an
embedding table's size is ever made. A tensor that later travels dense gets its residual
densified once.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple, Union

import numpy as np

from . import checkpoint
from .backend import arrays, kernels
from .errors import CommunicationError, ConfigError, quote
from .params import Component, Param
from .registry import register

#: A sparse residual's tensor size in a checkpoint (deepreduce.wire.container.MAX_TENSOR_NUMEL).
_NUMEL = Param(int, low=0, high=1 << 60, doc="elements of the residual's tensor")


class Compensated(NamedTuple):
    """What ``Memory.accumulate`` found: the compensated gradient, whether the gradient was
    finite, and (when asked for a Top-r) the selected positions."""

    flat: np.ndarray
    finite: bool
    selected: Optional[np.ndarray] = None


class SparseResidual(NamedTuple):
    """The residual of a tensor of ``numel`` elements whose gradients arrive as entries: ascending
    distinct flat ``positions`` (int64) and their float32 ``values`` (no zero among them)."""

    positions: np.ndarray
    values: np.ndarray
    numel: int

    def dense(self) -> np.ndarray:
        out = np.zeros(self.numel, dtype=np.float32)
        out[self.positions] = self.values
        return out


def union_sum(positions_a, values_a, positions_b, values_b) -> Tuple[np.ndarray, np.ndarray]:
    """Two sets of (distinct flat positions, float32 values) as one: every position of either,
    ascending, with the values added where both have it (``a``'s first, in float32)."""
    positions = np.concatenate((np.asarray(positions_a, np.int64), np.asarray(positions_b, np.int64)))
    merged, where = np.unique(positions, return_inverse=True)
    values = np.zeros(merged.shape[0], dtype=np.float32)
    np.add.at(values, where, np.concatenate((np.asarray(values_a, np.float32), np.asarray(values_b, np.float32))))
    return merged, values


class Memory(Component):
    """Base class: stateless by default (the compensated gradient is the gradient)."""

    kind = "memory"
    stateful = False
    #: keep a journaled step's second buffer for the next step (``Pipeline.collective_steps``)
    retain_spares = True

    def accumulate(self, name: str, flat: np.ndarray, topk: int = 0, threads: int = 1) -> Compensated:
        """Compensate ``flat`` (float32, flat) for ``name``; a non-finite gradient leaves the state alone.

        ``topk > 0``: also select the Top-``topk`` of the compensated gradient in the same pass.
        """
        finite, selected = kernels.scan(flat, None, topk, threads)
        return Compensated(flat, finite, selected)

    def compensate(self, name: str, flat: np.ndarray) -> np.ndarray:
        """The compensated gradient as a new array, leaving the state alone (staged encoders)."""
        return flat

    def settle(self, name: str, positions: Optional[np.ndarray], values: Optional[np.ndarray],
               threads: int = 1) -> None:
        """Take what the receiver reconstructs out of the residual (``residual[positions] -=
        values``, distinct positions); ``positions=None``: the whole tensor was sent exactly."""

    def take(self, name: str) -> Optional[np.ndarray]:
        """``name``'s residual as a float32 array, cleared in the memory (None when it holds
        nothing): the residual flush of a tensor the ``auto`` plan moved to a dense all-reduce."""
        return None

    def reset(self) -> None:
        """Forget every residual."""

    def snapshot(self, name: str):
        """A copy of what this memory holds for ``name``, for :meth:`restore` (a skipped step)."""
        return None

    def restore(self, name: str, snapshot) -> None:
        """Put back what :meth:`snapshot` returned."""

    def release(self, name: str, snapshot) -> None:
        """The step :meth:`snapshot` was taken for was applied: the snapshot is not needed."""


@register
class NoMemory(Memory):
    """No error feedback: what a sparsifier drops is lost."""

    id = "none"


@register
class ResidualMemory(Memory):
    """Error feedback: residual = compensated gradient - what the receiver reconstructs (float32)."""

    id = "residual"
    stateful = True

    def _init_state(self) -> None:
        self._residuals: Dict[str, Union[np.ndarray, SparseResidual]] = {}
        # A journal's snapshot is the residual array itself (no copy): until the step is
        # committed or undone that array is frozen, and the step writes a second buffer per
        # tensor instead, recycled from step to step (:meth:`step_buffers`).
        self._frozen: Dict[str, np.ndarray] = {}
        self._spares: Dict[str, np.ndarray] = {}

    def _existing(self, name: str, flat) -> Optional[np.ndarray]:
        residual = self._residuals.get(name)
        if residual is None:
            return None
        held = residual.numel if isinstance(residual, SparseResidual) else residual.shape[0]
        if held != flat.shape[0]:   # checked before a sparse one is densified (a checkpoint's numel)
            raise CommunicationError(
                f"residual memory: tensor {name!r} had {held} elements, now {flat.shape[0]}; "
                "a name must keep its size"
            )
        if isinstance(residual, SparseResidual):   # the tensor travelled as entries until now
            residual = self._residuals[name] = residual.dense()
        if arrays.is_torch(flat) and (not arrays.is_torch(residual) or residual.device != flat.device):
            residual = self._residuals[name] = arrays.adapter(flat).from_numpy(_host(residual), flat)
        elif not arrays.is_torch(flat) and arrays.is_torch(residual):
            residual = self._residuals[name] = _host(residual)
        return residual

    def accumulate(self, name, flat, topk=0, threads=1):
        residual = self._existing(name, flat)
        if residual is None:
            finite, selected = kernels.scan(flat, None, topk, threads)
            if not finite:
                return Compensated(flat, False)
            residual = self._residuals[name] = _copy(flat)
            return Compensated(residual, True, selected)
        prior, target = self.step_buffers(name)
        finite, selected = kernels.scan(flat, target, topk, threads, None if target is prior else prior)
        if not finite:   # the residual stays prior; the unused second buffer waits for the next step
            if target is not prior and self.retain_spares:
                self._spares[name] = target
            return Compensated(flat, False)
        self._residuals[name] = target
        return Compensated(target, True, selected)

    def step_buffers(self, name: str):
        """``(prior, target)`` for this step's compensation of ``name`` (it has a dense residual):
        the residual and the array to write ``prior + gradient`` into. One array (in place) unless
        a journal holds the residual as its snapshot; then a second buffer of the same size,
        recycled by :meth:`release` and :meth:`restore` (:attr:`retain_spares`; else allocated
        per step), so undoing a step costs no copy of the residual."""
        prior = self._residuals[name]
        if self._frozen.get(name) is not prior:
            return prior, prior
        spare = self._spares.pop(name, None)
        if not _same_buffer_kind(spare, prior):
            spare = arrays.namespace(prior).empty_like(prior)
        return prior, spare

    def _writable(self, name: str):
        """``name``'s dense residual, to change in place: a frozen one (a journal's snapshot) is
        first copied into the step's second buffer."""
        prior, target = self.step_buffers(name)
        if target is not prior:
            target[...] = prior
            self._residuals[name] = target
        return target

    def compensate(self, name, flat):
        residual = self._existing(name, flat)
        return _copy(flat) if residual is None else residual + flat

    def settle(self, name, positions, values, threads=1):
        residual = self._writable(name)
        if positions is None:
            residual[...] = 0.0
        elif len(positions):
            kernels.subtract_at(residual, positions, values, threads)

    def accumulate_entries(self, name: str, positions: np.ndarray, values: np.ndarray,
                           numel: int) -> Tuple[np.ndarray, np.ndarray]:
        """The compensated gradient of a gradient given by its entries, as entries: the union of
        its and the residual's, added where both have one (new arrays; the residual changes in
        :meth:`settle_entries`). A dense residual (the tensor travelled dense before) counts by
        its non-zeros."""
        held = self._residuals.get(name)
        if held is None:
            return np.asarray(positions, np.int64), np.array(values, dtype=np.float32, copy=True)
        if not isinstance(held, SparseResidual):
            dense = _host(held)
            held = SparseResidual(np.flatnonzero(dense), dense[dense != 0], dense.shape[0])
        if held.numel != numel:
            raise CommunicationError(f"residual memory: tensor {name!r} had {held.numel} elements, now {numel}; "
                                     "a name must keep its size")
        return union_sum(held.positions, held.values, positions, values)

    def settle_entries(self, name: str, positions: np.ndarray, compensated: np.ndarray, sent: np.ndarray,
                       received: np.ndarray, numel: int) -> None:
        """The residual after sending entries: the compensated entries minus what the receivers
        reconstruct at the ``sent`` positions (exact zeros dropped), kept sparse; ``sent=None``:
        everything was sent exactly (the residual is empty)."""
        if sent is None:
            self._residuals[name] = SparseResidual(np.zeros(0, np.int64), np.zeros(0, np.float32), int(numel))
            return
        merged, values = union_sum(positions, compensated, sent, -np.asarray(received, np.float32))
        keep = values != 0
        self._residuals[name] = SparseResidual(merged[keep], values[keep], int(numel))

    def residual(self, name: str) -> Optional[np.ndarray]:
        """The float32 residual currently held for ``name`` (dense: a sparse one is densified
        for good); None before its first step."""
        held = self._residuals.get(name)
        if isinstance(held, SparseResidual):
            held = self._residuals[name] = held.dense()
        return held

    def take(self, name: str) -> Optional[np.ndarray]:
        residual = self.residual(name)
        if residual is None or not residual.any():
            return None
        out = residual.copy()
        self._writable(name)[...] = 0.0
        return out

    def hold(self, name: str, residual: np.ndarray) -> None:
        """Keep ``residual`` as ``name``'s: the one the C++ pipeline created on the tensor's first
        finite step (``shards.encode_shards``), exactly what :meth:`accumulate` would have made."""
        self._residuals[name] = residual

    def reset(self):
        self._residuals.clear()
        self._frozen.clear()
        self._spares.clear()

    def snapshot(self, name):
        """The residual itself, frozen until :meth:`release` or :meth:`restore` (a sparse one is
        replaced, never changed in place; a dense one is written out of place meanwhile)."""
        residual = self._residuals.get(name)
        if residual is not None and not isinstance(residual, SparseResidual):
            self._frozen[name] = residual
        return residual

    def restore(self, name, snapshot):
        self._unfreeze(name, keep=snapshot)
        if snapshot is None:
            self._residuals.pop(name, None)     # the tensor had no residual before the step
        else:
            self._residuals[name] = snapshot

    def release(self, name, snapshot):
        self._unfreeze(name, keep=self._residuals.get(name), spare=snapshot)

    def _unfreeze(self, name: str, keep, spare=None) -> None:
        """End ``name``'s freeze; the one of the step's two buffers not kept becomes its spare
        (dropped unless :attr:`retain_spares`)."""
        self._frozen.pop(name, None)
        spare = self._residuals.get(name) if spare is None else spare
        if (self.retain_spares and spare is not keep and spare is not None
                and not isinstance(spare, SparseResidual)):
            self._spares[name] = spare

    def state_dict(self) -> dict:
        """``{"residuals": {name: residual}}`` (copies), for checkpoints; a sparse residual as
        ``{"positions", "values", "numel"}``."""
        return {"residuals": {name: {"positions": r.positions.copy(), "values": r.values.copy(), "numel": r.numel}
                              if isinstance(r, SparseResidual) else _host(r).copy()
                              for name, r in self._residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Replace every residual with the checkpoint's; errors name a malformed entry
        (:mod:`deepreduce.checkpoint`)."""
        owner = f"memory {self.id!r}"
        loaded = {}
        for name, residual in residual_entries(owner, state, "array"):
            if isinstance(residual, dict):
                loaded[name] = _checked_sparse(owner, name, residual)
            else:
                loaded[name] = checkpoint.checked_array(owner, f"residual {name!r}", residual, "float")
        self.reset()
        self._residuals.update(loaded)


def residual_entries(owner: str, state: dict, kind: str):
    """(name, entry) of a memory checkpoint's ``{"residuals": {name: entry}}``, the names checked
    (ConfigError naming ``owner``; ``kind`` says what an entry is)."""
    residuals = checkpoint.checked_keys(owner, state, ("residuals",))["residuals"]
    if not isinstance(residuals, dict):
        raise ConfigError(f"{owner}: 'residuals' must be a dict of name -> {kind}")
    for name, entry in residuals.items():
        if not isinstance(name, str):
            raise ConfigError(f"{owner}: residual names must be strings, got {quote(name)}")
        yield name, entry


def _checked_sparse(owner: str, name: str, state: dict) -> SparseResidual:
    """A checkpoint's sparse residual, checked: a tensor of at most 2**60 elements, ascending
    distinct positions inside it, as many finite float values."""
    state = checkpoint.checked_keys(f"{owner} sparse residual {name!r}", state, ("positions", "values", "numel"))
    numel = checkpoint.checked_fields(f"{owner} sparse residual {name!r}", {"numel": state["numel"]},
                                      {"numel": _NUMEL})["numel"]
    positions = checkpoint.checked_array(owner, f"sparse residual {name!r} positions", state["positions"], "int")
    values = checkpoint.checked_array(owner, f"residual {name!r}", state["values"], "float",
                                      length=positions.shape[0])
    if positions.size and (positions[0] < 0 or positions[-1] >= numel or np.any(np.diff(positions) <= 0)):
        raise ConfigError(f"{owner}: sparse residual {name!r} has positions that are not ascending "
                          f"and distinct inside its {numel} elements")
    return SparseResidual(positions, values, numel)


def _copy(flat):
    """A float32 copy of a flat gradient in its own framework and device."""
    xp = arrays.namespace(flat)
    return xp.asarray(flat, dtype=xp.float32, copy=True)


def _same_buffer_kind(spare, residual) -> bool:
    """Whether ``spare`` can hold ``residual``'s values: same length, framework and device."""
    if spare is None or spare.shape != residual.shape or arrays.is_torch(spare) != arrays.is_torch(residual):
        return False
    return not arrays.is_torch(spare) or spare.device == residual.device


def _host(residual) -> np.ndarray:
    """A residual as a float32 NumPy array (a torch residual is copied to the host)."""
    return np.asarray(arrays.adapter(residual).to_numpy(residual), dtype=np.float32)


@register
class DecayedResidualMemory(ResidualMemory):
    """Decayed error feedback (SparseLoCo's accumulator): ``e <- decay * e + g``; the sparsifier
    reads ``e``; ``e <- e - (what the receiver reconstructs)``.

    ``decay = 1`` is :class:`ResidualMemory` exactly (the same code runs). Below 1 the residual is
    scaled in float32 (``fl(e * fl32(decay))``, the same rounding in NumPy and torch) once the
    gradient is known to be finite, so a refused (non-finite) gradient leaves the state untouched;
    a gradient given by entries decays its sparse residual the same way. Conservation with decay:
    ``sum_t decay**(T-t) (g_t - s_t) = e_T`` (to float32 rounding), which tests/test_memory.py checks.
    """

    id = "decayed_residual"
    PARAMS = {"decay": Param(float, default=0.95, low=0.0, high=1.0, low_open=True,
                             doc="factor beta applied to the residual before each gradient is added")}

    def _decay(self, name: str) -> None:
        """Scale ``name``'s residual by ``decay``: a dense one in place, a sparse one replaced."""
        held = self._residuals.get(name)
        if held is None:
            return
        beta = np.float32(self.decay)
        if isinstance(held, SparseResidual):
            values = held.values * beta
            keep = values != 0
            self._residuals[name] = SparseResidual(held.positions[keep], values[keep], held.numel)
        else:   # in place, or into the step's second buffer while a journal holds the residual
            prior, target = self.step_buffers(name)
            arrays.namespace(prior).multiply(prior, float(beta) if arrays.is_torch(prior) else beta, out=target)
            self._residuals[name] = target

    def accumulate(self, name, flat, topk=0, threads=1):
        if self.decay != 1.0 and self._existing(name, flat) is not None:   # size checked before any change
            finite, _ = kernels.scan(flat, None, 0, threads)
            if not finite:
                return Compensated(flat, False)
            self._decay(name)
        return super().accumulate(name, flat, topk, threads)

    def compensate(self, name, flat):
        residual = self._existing(name, flat)
        if residual is None or self.decay == 1.0:
            return super().compensate(name, flat)
        beta = np.float32(self.decay)
        return residual * (float(beta) if arrays.is_torch(residual) else beta) + flat

    def accumulate_entries(self, name, positions, values, numel):
        if self.decay != 1.0:
            self._decay(name)   # settle_entries rebuilds the residual from the compensated entries
        return super().accumulate_entries(name, positions, values, numel)
