"""The sparse all-reduce's encodes, written on the pipeline's stages (``Pipeline.compensate``,
``select``, ``pack_selection``, ``settle``, ``pack``):

* :func:`encode_shards`: one container per contiguous shard of a gradient, the first phase of the
  sparse all-reduce (:mod:`deepreduce.collective.sparse_allreduce`) and the compressed
  reduce-scatter (:mod:`deepreduce.collective.routes.shard`);
* :func:`encode_owned`: the owner's re-selection of its summed shard, and :func:`encode_dense`,
  a summed shard sent as it is.

They live beside the routes that use them, not in the pipeline: each route owns its encode.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ..backend import arrays, native_pipeline
from ..errors import DeepReduceError, NonFiniteGradientError
from ..pipeline import CompensationOverflow, Pipeline, as_flat_float32, dense_container


def encode_shards(core: Pipeline, grad, name: str, step: int, bounds: Sequence[int]) -> list:
    """One container per contiguous shard ``[bounds[j], bounds[j+1])`` of one gradient.

    Compensation and selection run once over the whole tensor, exactly as ``Pipeline.encode``
    does; the selected entries of each shard are packed with the config's codecs as a tensor of
    the shard's length (indices relative to its start, seeded as ``name#j``), and the residual
    keeps what the receivers do not reconstruct. A non-finite gradient sends every shard dense
    and flagged; a tensor below ``min_numel``, or a warm-up step, every shard dense. NumPy input
    (a torch binding passes its host view). In one C++ call when the config runs there
    (``Pipeline.native``; byte-identical, tests/test_native_pipeline.py).
    """
    start = time.perf_counter()
    flat, _ = as_flat_float32(grad, name)
    numel = flat.shape[0]
    bounds = [int(b) for b in bounds]
    if bounds[0] != 0 or bounds[-1] != numel or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise DeepReduceError(f"encode_shards: bounds {bounds[:4]}... must rise from 0 to {numel}")
    sparse = numel >= core.min_numel and not core.warming_up(step)
    native = core.native
    residual = core.memory.residual(name) if native is not None and core.memory.stateful else None
    if native is not None and not arrays.is_torch(flat) and not arrays.is_torch(residual):
        core.save_state(name)
        prior, target = core.memory.step_buffers(name) if residual is not None else (None, None)
        return _encode_shards_native(core, native, flat, name, step, bounds, prior, target, start)
    comp = core.compensate(flat, name, selecting=sparse)
    shards = list(zip(bounds, bounds[1:]))
    if not comp.finite:
        parts = [dense_container(flat[lo:hi], (hi - lo,), nonfinite=True) for lo, hi in shards]
    elif not sparse:
        parts = [dense_container(comp.flat[lo:hi], (hi - lo,)) for lo, hi in shards]
        core.settle(name)
    else:
        chosen = core.select(comp, core.context(name, step))
        cuts = np.searchsorted(chosen, bounds)
        parts, positions, received = [], [], []
        for j, (lo, hi) in enumerate(shards):   # a slice of the selection per shard
            c, sent, values = core.pack_selection(comp.flat[lo:hi], chosen[cuts[j]:cuts[j + 1]] - lo,
                                                  core.context(f"{name}#{j}", step))
            parts.append(c)
            positions.append(np.asarray(sent, dtype=np.int64) + lo)
            received.append(values)
        core.settle(name, np.concatenate(positions), np.concatenate(received))
    return core.pack(parts, start)


def _encode_shards_native(core: Pipeline, native, flat, name: str, step: int, bounds: list, prior, target,
                          start: float) -> list:
    """:func:`encode_shards` in one C++ call, compensating ``prior`` into ``target`` (the memory's
    step buffers: one array in place, or two when a journal keeps ``prior``); the residual it
    writes, or creates on a tensor's first step, becomes the pipeline's (``Memory.hold``)."""
    try:
        payloads, held, sections = native_pipeline.encode_shards(native, core.native_settings, name, step, flat,
                                                                  bounds, target, None if target is prior else prior)
    except NonFiniteGradientError as exc:
        raise CompensationOverflow(str(exc)) from exc
    if held is not None and held is not prior:
        core.memory.hold(name, held)
    seconds = (time.perf_counter() - start) / max(1, len(payloads))
    for (lo, hi), payload, (index, value, perm) in zip(zip(bounds, bounds[1:]), payloads, sections):
        core.count_encoded(payload.shape[0], hi - lo, index, value, perm, seconds)
    return payloads


def encode_owned(core: Pipeline, total: np.ndarray, positions: np.ndarray, name: str, step: int):
    """``(container, sent positions, the values receivers reconstruct there)`` for the given
    ascending ``positions`` of the flat float32 ``total`` (no error feedback: the owner keeps its
    own residual; the sparse all-reduce owner's re-selection), counted in the pipeline's stats."""
    start = time.perf_counter()
    c, sent, values = core.pack_selection(total, np.asarray(positions, dtype=np.int64), core.context(name, step))
    return core.pack([c], start)[0], np.asarray(sent, dtype=np.int64), values


def encode_dense(core: Pipeline, flat: np.ndarray, flagged: bool = False) -> np.ndarray:
    """A dense container of the flat float32 ``flat`` (``flagged``: marked non-finite, as the
    ``propagate`` policy sends a NaN/Inf gradient); not counted in the stats."""
    return core.pack([dense_container(flat, (flat.shape[0],), nonfinite=flagged)])[0]
