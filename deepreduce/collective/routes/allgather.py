"""The allgather of containers (DeepReduce's scheme): every rank receives every rank's container,
decodes each from its segment of the gathered buffer and sums them into the tensor. An item of
several parts (a DDP bucket) sends their containers concatenated, in one collective."""
from __future__ import annotations

import numpy as np

from ...backend import arrays
from ...errors import DeepReduceError
from .. import agreement, failure
from ._base import Outcome, Route


def joined(payloads):
    """Payloads (NumPy uint8, or torch uint8 on one device) end to end; one payload as it is."""
    if len(payloads) == 1:
        return payloads[0]
    return arrays.adapter(payloads[0]).concat_bytes(payloads) if arrays.is_torch(payloads[0]) \
        else np.concatenate([np.asarray(p, dtype=np.uint8) for p in payloads])


def per_part(engine, item, payloads):
    """Every rank's containers of each part: ``[part][rank]`` (each a segment of what was received)."""
    if len(item.parts) == 1:
        return [payloads]
    per_rank = engine.protocol.split_per_rank(payloads, len(item.parts), item.label, item.step)
    return [[parts[i] for parts in per_rank] for i in range(len(item.parts))]


def first_flagged(item, groups):
    """(the first flagged part's name, its non-finite report), or ("", None)
    (:func:`deepreduce.collective.agreement.first_nonfinite`)."""
    flagged = ((part[0], agreement.first_nonfinite(group)) for part, group in zip(item.parts, groups))
    return next(((name, found) for name, found in flagged if found is not None), ("", None))


class Allgather(Route):
    id = "allgather"
    ORDER = 0

    def __init__(self, engine) -> None:
        self.engine = engine

    def start(self, engine, item):
        payload = joined([engine.codec.encode(tensor, name=name, step=item.step) for name, tensor, _ in item.parts])
        return self._gather(engine, item, payload)

    def fail(self, engine, item, error):
        return self._gather(engine, item, failure.payload(error))

    @staticmethod
    def _gather(engine, item, payload):
        if arrays.is_torch(payload) and payload.device.type == "cpu":
            payload = payload.numpy()   # a host torch payload gathers as NumPy; device bytes stay there
        return engine.gather(item, payload)

    def finish(self, engine, item, pending):
        payloads = pending.wait()
        failure.raise_if_failed(payloads, item.label, item.step)
        groups = per_part(engine, item, payloads)

        def write(divisor: int) -> None:
            for (name, _, target), received in zip(item.parts, groups):
                shape = tuple(engine.tensors.shape(target))
                in_place = divisor == 1 or engine.tensors.float32(target)   # else: divided in float32 first
                try:
                    total = engine.codec.decode_sum(received, expected_shape=shape, out=target if in_place else None)
                except DeepReduceError as exc:
                    raise type(exc)(f"{item.part_label(name)}: {exc}") from exc
                if divisor != 1:
                    engine.tensors.divide(total, divisor)
                if not in_place:   # a bf16/fp16 target: the float32 quotient, rounded once
                    engine.tensors.copy(target, total)
        name, found = first_flagged(item, groups)
        return Outcome(write, found, name)
