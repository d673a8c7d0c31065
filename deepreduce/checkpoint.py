"""The framework-blind part of a compression checkpoint, shared by the torch and TF bindings,
and the one set of checks every ``load_state_dict`` runs on what it is given.

A binding saves ``{"format": STATE_FORMAT, "step": int, "compression": dict}``: its step counter
and what the pipeline (residuals, adaptive state) or summable compressor learned, plus
``"aggregation"`` (the sparse all-reduce's owner residuals and shard bounds) where one runs. The bindings
convert the arrays to their framework's type (deepreduce/torch/checkpoint.py) or keep NumPy
(deepreduce/tensorflow/pipeline.py); :func:`checked_step` is the one check of such a dict.

A checkpoint is input like a container: a file from another run, version or user. Whatever a
component restores, it checks first, with the helpers here, so that a field out of its range is
refused on load with a ``ConfigError`` naming it, instead of hanging or failing every later step
(a SIDCo stage count of ``10**9`` made the next encode loop for minutes; a step of ``2**70``
overflowed the int64 seed of every later step). :func:`checked_fields` checks scalars against
:class:`~deepreduce.params.Param` declarations (the same rules as config parameters),
:func:`checked_array` arrays (kind, rank, length, finiteness).
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np

from .errors import ConfigError, quote
from .params import Param
from .wire.container import MAX_TENSOR_NUMEL

STATE_FORMAT = 1
STATE_KEYS = ("format", "step", "compression")
#: The highest step a checkpoint may hold: seeds take the step as an int64
#: (deepreduce/wire/seeding.py), and 2**62 leaves 2**62 more steps before that overflows.
MAX_STEP = 1 << 62
STEP = Param(int, low=0, high=MAX_STEP, doc="steps taken")
#: A count kept in a checkpoint (bytes, buckets, selected entries): non-negative, below 2**62.
COUNT = Param(int, low=0, high=MAX_STEP, doc="a running count")
SECONDS = Param(float, low=0.0, doc="a running time")


def scalar(value):
    """A checkpoint's scalar as a Python value: NumPy scalars and 0-d arrays (what ``np.savez``,
    ``torch.load`` + ``to_numpy`` give back) become ``bool``/``int``/``float``; anything else is
    returned unchanged for the caller's check to refuse."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return value.item()
    return value


def checked_keys(owner: str, state, keys: Sequence[str]) -> dict:
    """``state`` if it is a dict with exactly ``keys``; a ConfigError naming the difference otherwise."""
    if not isinstance(state, dict) or set(state) != set(keys):
        got = sorted(map(str, state))[:8] if isinstance(state, dict) else type(state).__name__
        raise ConfigError(f"{owner}: checkpoint state must have the keys {sorted(keys)}, got {quote(got)}")
    return state


def checked_fields(owner: str, state, fields: Mapping[str, Param]) -> dict:
    """The scalar fields of ``state`` (a dict with exactly the keys of ``fields``), each checked
    and converted by its :class:`Param` (type, range, finiteness); a ConfigError names ``owner``
    and the field."""
    state = checked_keys(owner, state, tuple(fields))
    return {key: param.check(owner, key, scalar(state[key]), "checkpoint field") for key, param in fields.items()}


def checked_array(owner: str, what: str, value, kind: str, length: Optional[int] = None,
                  finite: bool = True, shape: Optional[tuple] = None) -> np.ndarray:
    """``value`` as a new NumPy array of ``kind`` ("float": float32, "float64", "int": int64),
    checked: an array of that kind, 1-D (of ``length`` entries when given) or of exactly
    ``shape``, and for floats finite within the dtype's range (unless ``finite=False``). Errors
    read "``owner``: ``what`` must be ..."; ``what`` names the field (e.g. ``residual 'fc'``)."""
    want = f"a {kind} array of shape {shape}" if shape is not None else \
        f"a 1-D {kind} array" + (f" of {length} entries" if length is not None else "")
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as exc:   # ragged lists, objects without an array form
        raise ConfigError(f"{owner}: {what} must be {want} ({exc})") from None
    expected = array.ndim == 1 and (length is None or array.shape[0] == length) if shape is None else \
        array.shape == tuple(shape)
    if not expected or not np.issubdtype(array.dtype, np.integer if kind == "int" else np.floating):
        raise ConfigError(f"{owner}: {what} must be {want}, got {array.dtype} of shape {array.shape}")
    if kind == "int":
        if array.dtype.kind == "u" and array.size and array.max() > np.iinfo(np.int64).max:
            raise ConfigError(f"{owner}: {what} holds a value beyond int64")
        return array.astype(np.int64)
    with np.errstate(over="ignore"):
        out = array.astype(np.float64 if kind == "float64" else np.float32)
    if finite and not np.isfinite(out).all():
        raise ConfigError(f"{owner}: {what} holds NaN/Inf (or values beyond {out.dtype}'s range); a checkpoint "
                          "must hold finite values")
    return out


def checked_totals(owner: str, totals, keys: Sequence[str]) -> dict:
    """Running totals (a dict with exactly ``keys``; ``*_seconds`` non-negative floats, the
    others counts in ``[0, 2**62]``), checked."""
    return checked_fields(f"{owner} statistics", totals,
                          {key: SECONDS if key.endswith("_seconds") else COUNT for key in keys})


def checked_progress(owner: str, step, totals, keys: Sequence[str]) -> None:
    """Check an integration's own progress (a restored or unpickled DDP hook state): its
    ``step`` and its running ``totals`` of ``keys``."""
    STEP.check(owner, "step", scalar(step), "checkpoint field")
    checked_totals(owner, totals, keys)


def state(step: int, learned: dict, aggregation=None) -> dict:
    """A checkpoint of ``learned`` (and the aggregation's state, when given) at ``step``."""
    out = {"format": STATE_FORMAT, "step": step, "compression": learned}
    if aggregation is not None:
        out["aggregation"] = aggregation
    return out


def checked_step(state: dict, owner: str, aggregation: bool = False) -> int:
    """The step of a checkpoint, after checking its keys (``aggregation``: it must hold the
    aggregation's state too), format and step (an int in ``[0, 2**62]``); errors name ``owner``."""
    expected = set(STATE_KEYS) | ({"aggregation"} if aggregation else set())
    if not isinstance(state, dict) or set(state) != expected:
        got = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise ConfigError(f"{owner}.load_state_dict: expected the keys {sorted(expected)}, got {quote(got)}")
    if scalar(state["format"]) != STATE_FORMAT:
        raise ConfigError(f"{owner}.load_state_dict: checkpoint format {quote(state['format'])}, "
                          f"this version reads {STATE_FORMAT}")
    return STEP.check(f"{owner}.load_state_dict", "step", scalar(state["step"]), "checkpoint field")


def checked_aggregation(owner: str, state, ranks: int) -> dict:
    """The sparse all-reduce's checkpoint (``{"owner_residuals": {name: float32 array},
    "bounds": {name: int64 array}}``) checked for ``ranks`` ranks: string names, finite 1-D
    residuals, ``ranks + 1`` bounds rising from 0 to the residual's length where both are held."""
    state = checked_keys(f"{owner} aggregation", state, ("owner_residuals", "bounds"))
    out = {}
    for part in ("owner_residuals", "bounds"):
        held = state[part]
        if not isinstance(held, dict) or not all(isinstance(name, str) for name in held):
            raise ConfigError(f"{owner} aggregation: checkpoint field {part!r} must map tensor names to arrays")
        kind, length = ("float", None) if part == "owner_residuals" else ("int", ranks + 1)
        out[part] = {name: checked_array(f"{owner} aggregation", f"{part} of {quote(name)}", value, kind, length)
                     for name, value in held.items()}
    for name, bounds in out["bounds"].items():
        residual = out["owner_residuals"].get(name)
        top = int(bounds[-1]) if residual is None else residual.shape[0]
        if bounds[0] != 0 or np.any(np.diff(bounds) < 0) or bounds[-1] != top or top > MAX_TENSOR_NUMEL:
            raise ConfigError(f"{owner} aggregation: shard bounds of {name!r} must rise from 0 to the tensor's "
                              f"{top} elements in {ranks + 1} steps, got {quote(bounds.tolist())}")
    return out
