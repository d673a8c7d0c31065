"""A sparse gradient (torch sparse COO, TF ``IndexedSlices``) sent as its touched entries in one
container (``Pipeline.encode_entries``), allgathered, and summed without a dense tensor."""
from __future__ import annotations

import numpy as np

from ...errors import DeepReduceError
from .. import agreement, failure
from ._base import Outcome, Route


class Entries(Route):
    id = "entries"
    ORDER = 0

    def __init__(self, engine) -> None:
        self.engine = engine

    def start(self, engine, item):
        positions, values = engine.tensors.entries(item.grad)
        payload = engine.core.encode_entries(positions, values, tuple(engine.tensors.shape(item.grad)),
                                             name=item.name, step=item.step)
        return engine.gather(item, payload)

    def fail(self, engine, item, error):
        return engine.gather(item, failure.payload(error))

    def finish(self, engine, item, pending):
        payloads = [failure.on_host(p) for p in pending.wait()]   # the core decodes host bytes
        failure.raise_if_failed(payloads, item.label, item.step)

        def write(divisor: int) -> None:
            try:
                positions, values = engine.core.decode_entries(payloads, tuple(engine.tensors.shape(item.target)))
            except DeepReduceError as exc:
                raise type(exc)(f"{item.label}: {exc}") from exc
            if divisor != 1:
                np.divide(values, divisor, out=values)
            item.replace(engine.tensors.from_entries(positions, values, like=item.target))
        return Outcome(write, agreement.first_nonfinite(payloads))
