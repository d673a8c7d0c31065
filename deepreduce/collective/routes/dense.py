"""A tensor summed by the binding's all-reduce, in float32 (``dense``) or float16 (``fp16``): a
small tensor the framework's fusion sends best (``Pipeline.summed_dense``), or one the ``auto``
plan leaves uncompressed because its communication hides behind backward. What error feedback
had held back for the tensor goes with it (the residual flush), so nothing is lost when the plan
moves a tensor off compression."""
from __future__ import annotations

import numpy as np

from . import Outcome, Route


class Dense(Route):
    id = "dense"
    ORDER = 0
    dtype = "float32"

    def __init__(self, engine) -> None:
        self.engine = engine

    def start(self, engine, item):
        tensors = engine.tensors
        if item.summed_dense:
            engine.core.count_summed_dense(tensors.numel(item.grad))
        else:
            residual = engine.protocol.take_residual(item.name)
            if residual is not None:
                tensors.add(item.grad, residual)
        sent = item.grad if self.dtype == "float32" else tensors.cast(item.grad, self.dtype)
        return sent, engine.allreduce(sent, item.name, False)

    def fail(self, engine, item, error):
        """A rank that could not prepare its tensor still all-reduces one of the same shape, made
        of NaN (an all-reduce has no room for a failure payload): every rank stays in phase and
        sees a non-finite sum, which the ``nonfinite`` policy handles as any NaN gradient (the
        step skipped on every rank under ``raise``; NaN handed on, and counted, under
        ``propagate``); the rank itself raises its own error."""
        sent = engine.tensors.cast(item.grad, self.dtype)
        engine.tensors.fill_nan(sent)
        return sent, engine.allreduce(sent, item.name, False)

    def finish(self, engine, item, started):
        sent, pending = started
        pending.wait()
        flat = engine.tensors.host(sent)
        found = None if np.isfinite(flat).all() else (-1, int(np.isnan(flat).sum()), int(np.isinf(flat).sum()))

        def write(divisor: int) -> None:
            if sent is not item.target:
                engine.tensors.copy(item.target, sent)
            if divisor != 1:
                engine.tensors.divide(item.target, divisor)
        return Outcome(write, found)


class Fp16(Dense):
    id = "fp16"
    dtype = "float16"
