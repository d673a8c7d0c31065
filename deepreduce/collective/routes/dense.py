"""A tensor summed by the binding's all-reduce, in float32 (``dense``) or float16 (``fp16``): a
small tensor the framework's fusion sends best (:func:`summed_dense`), or one the ``auto``
plan leaves uncompressed because its communication hides behind backward. What error feedback
had held back for the tensor goes with it (the residual flush), so nothing is lost when the plan
moves a tensor off compression.

An all-reduce has no room for a failure payload, so every tensor on an all-reduce route whose
preparation can fail (a residual flush, a cast, a compressor) travels with one more element, a flag: 0 from a rank that sent its data, 1 from a rank whose preparation
raised (it sends zeros). The sum's flag tells every rank at once that the step failed, so every
rank raises and none applies a partial sum. :func:`flagged` and :func:`unflagged` are the one
definition, which the summable route shares.
"""
from __future__ import annotations

import numpy as np

from ...errors import CommunicationError
from ._base import Outcome, Route


def summed_dense(core, numel: int) -> bool:
    """Whether a tensor of ``numel`` elements may skip the container and be summed by a plain
    all-reduce under the pipeline ``core``: it travels dense anyway (below ``min_numel``), so
    the sum is the same, and under ``nonfinite: propagate`` a NaN/Inf reaches every rank in it
    just as in a container. The integrations then hand such tensors to the framework's
    all-reduce, whose tensor fusion sends the many small tensors of a model (biases, norms) in
    one message instead of one container (header, checksum, parse) each. Under ``nonfinite:
    raise`` they keep their containers, which name the rank that sent a NaN.
    """
    return numel < core.min_numel and core.nonfinite == "propagate"


def count_summed_dense(core, numel: int) -> None:
    """Count a tensor :func:`summed_dense` sent by all-reduce in ``core.stats`` (its bytes as sent)."""
    stats = core.stats
    stats.tensors_encoded += 1
    stats.dense_bytes += 4 * numel
    stats.wire_bytes += 4 * numel
    stats.value_bytes += 4 * numel


def flagged(tensors, data, dtype: str, failed: bool):
    """A new flat tensor: ``data`` (a tensor, or several end to end; zeros where ``failed``) in
    ``dtype``, then the flag."""
    return tensors.with_flag(data, dtype, 1.0 if failed else 0.0)


def unflagged(tensors, summed, item):
    """The sum's data (a view) after checking its flag; a CommunicationError names the step when
    any rank failed (that rank raises its own error instead)."""
    data, flag = tensors.split_flag(summed)
    if flag != 0.0:
        raise CommunicationError(f"{item.label} at step {item.step}: a rank could not prepare its gradient "
                                 "(it raises its own error); every rank skips this step")
    return data


def nonfinite_report(tensors, data):
    """(-1, NaN count, Inf count) when the sum holds NaN/Inf (the rank is unknown in a sum), else None."""
    if tensors.all_finite(data):
        return None
    flat = tensors.host(data)
    return -1, int(np.isnan(flat).sum()), int(np.isinf(flat).sum())


class Dense(Route):
    id = "dense"
    ORDER = 0
    dtype = "float32"

    def __init__(self, engine) -> None:
        self.engine = engine

    def start(self, engine, item):
        tensors = engine.tensors
        if self._in_place(item):   # nothing here can fail: summed where it lies, no flag, no copy
            count_summed_dense(engine.core, tensors.numel(item.grad))
            return None, engine.allreduce(item.grad, item, False)
        for name, tensor, _ in item.parts:
            residual = engine.protocol.take_residual(name)
            if residual is not None:
                tensors.add(tensor, residual)
        sent = flagged(tensors, [tensor for _, tensor, _ in item.parts], self.dtype, failed=False)
        return sent, engine.allreduce(sent, item, False)

    def _in_place(self, item) -> bool:
        """A small float32 tensor the binding lets its framework's fused all-reduce sum
        (``summed_dense``): its start only counts it, so it has no failure to announce, and it is
        all-reduced in place like Horovod's own (the per-tensor flag copy cost the main job ~4%)."""
        return item.summed_dense and self.dtype == "float32" and len(item.parts) == 1 \
            and item.parts[0][1] is item.parts[0][2] and self.engine.tensors.float32(item.grad)

    def fail(self, engine, item, error):
        sent = flagged(engine.tensors, [tensor for _, tensor, _ in item.parts], self.dtype, failed=True)
        return sent, engine.allreduce(sent, item, False)

    def finish(self, engine, item, started):
        sent, pending = started
        pending.wait()
        data = item.grad if sent is None else unflagged(engine.tensors, sent, item)

        def write(divisor: int) -> None:
            at = 0
            for _, _, target in item.parts:   # each part's elements, in the order they were sent
                numel = engine.tensors.numel(target)
                if sent is None:   # summed in place (float32)
                    if divisor != 1:
                        engine.tensors.divide(target, divisor)
                    continue
                part, at = data[at:at + numel], at + numel
                if engine.tensors.float32(target):
                    engine.tensors.copy(target, part)
                    if divisor != 1:
                        engine.tensors.divide(target, divisor)
                else:   # a bf16 target: the quotient in the sum's dtype, rounded once
                    if divisor != 1:
                        engine.tensors.divide(part, divisor)
                    engine.tensors.copy(target, part)
        return Outcome(write, nonfinite_report(engine.tensors, data))


class Fp16(Dense):
    id = "fp16"
    dtype = "float16"
