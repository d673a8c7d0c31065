"""The C++ pipeline subset (csrc/pipeline): which core pipelines it runs and with what settings.

``csrc/pipeline`` encodes one float32 tensor and decodes (and sums) containers for the configs
whose every stage exists in C++: Top-r or threshold selection with or without error feedback,
raw, Elias-Fano or Bloom indices (every policy), raw, fp16 or polyfit values (which configs:
``Pipeline.native_reason``). The TensorFlow custom ops (:mod:`deepreduce.tensorflow.ops`) run it, and
``deepreduce._pipeline`` binds the same functions for NumPy. The stages it has are named here by
their component ids (the core's ``_native_reason`` reads them), and the core reads its components
into the plain settings both take (``Pipeline.native_settings``): this layer imports no component
and restates no codec.
:func:`encode_shards`, :func:`decode_sum` and :func:`decode_shards` are the sparse all-reduce's
calls into it (one call per tensor and phase instead of a Python loop over the ranks' containers),
with its errors raised as the core's classes.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from ..errors import ContainerError, DeepReduceError
from . import _native

# The component ids of the stages csrc/pipeline has; which configs run here is decided by
# Pipeline.native_reason from these (one rule).
SPARSIFIERS = ("topk", "threshold")
INDEX_CODECS = ("raw", "bloom", "elias_fano")
VALUE_CODECS = ("raw", "fp16", "polyfit")
MEMORIES = ("none", "residual")


def module():
    """The C++ pipeline (``deepreduce._pipeline``), or None when it is not built or
    ``DEEPREDUCE_BACKEND=numpy`` is set."""
    return _native.load("pipeline")


def encode_shards(native, config: dict, name: str, step: int, flat: np.ndarray, bounds: Sequence[int],
                  residual: Optional[np.ndarray], prior: Optional[np.ndarray] = None):
    """``native.encode_shards`` (see :func:`deepreduce.collective.shards.encode_shards`): (containers, the residual, each
    container's (index, value, permutation) section bytes). ``residual`` receives ``prior + flat``
    (``prior=None``: in place; ``Memory.step_buffers``). A codec's refusal (fp16 range,
    polyfit) is raised as DeepReduceError; a residual of another size as CommunicationError and
    an overflowing compensation as NonFiniteGradientError, as the C++ pipeline raises them."""
    try:
        return native.encode_shards(config, name, step, flat, list(bounds), residual, prior)
    except ValueError as exc:   # ErrorKind::ENCODE (the settings come from a built pipeline)
        raise DeepReduceError(str(exc)) from exc


def decode_sum(native, payloads: Sequence, numel: int, threads: int) -> np.ndarray:
    """The flat sum of ``payloads`` (containers of ``numel``-element flat tensors), each decoded
    where it lies in the received buffer; errors as ``Pipeline.decode_sum`` raises them."""
    try:
        return native.decode_parts(payloads, shape=(numel,), threads=threads)
    except ValueError as exc:   # ErrorKind::CONTAINER
        raise ContainerError(str(exc)) from exc


def decode_shards(native, payloads: Sequence, bounds: Sequence[int], out: np.ndarray, threads: int,
                  divisor: int = 1) -> None:
    """Container ``j`` of ``payloads`` written to ``out[bounds[j]:bounds[j+1]]`` (its shape checked),
    each value divided by ``divisor``; errors in the containers as ``Pipeline.decode`` raises them,
    a divisor that is not a positive finite number as ``ValueError`` (the caller's mistake, not the
    bytes')."""
    if not (math.isfinite(divisor) and divisor > 0):
        raise ValueError(f"decode_shards: divisor must be a positive finite number, got {divisor!r}")
    try:
        native.decode_shards(payloads, list(bounds), out, threads, float(divisor))
    except ValueError as exc:   # ErrorKind::CONTAINER
        raise ContainerError(str(exc)) from exc
