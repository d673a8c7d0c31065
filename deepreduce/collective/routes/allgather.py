"""The allgather of containers (DeepReduce's scheme): every rank receives every rank's container,
decodes each from its segment of the gathered buffer and sums them into the tensor."""
from __future__ import annotations

from ...backend import arrays
from ...errors import DeepReduceError
from .. import agreement, failure, ports
from ._base import Outcome, Route


class Allgather(Route):
    id = "allgather"
    ORDER = 0

    def __init__(self, engine) -> None:
        self.engine = engine

    def start(self, engine, item):
        payload = engine.codec.encode(item.grad, name=item.name, step=item.step)
        return self._gather(engine, item, payload)

    def fail(self, engine, item, error):
        return self._gather(engine, item, failure.payload(error))

    @staticmethod
    def _gather(engine, item, payload):
        if arrays.is_torch(payload) and payload.device.type == "cpu":
            payload = payload.numpy()   # a host torch payload gathers as NumPy; device bytes stay there
        return ports.start_allgather(engine.communicator, payload, f"deepreduce.{item.name}")

    def finish(self, engine, item, pending):
        payloads = pending.wait()
        failure.raise_if_failed(payloads, item.label, item.step)

        def write(divisor: int) -> None:
            try:
                engine.codec.decode_sum(payloads, expected_shape=tuple(engine.tensors.shape(item.target)),
                                        out=item.target)
            except DeepReduceError as exc:
                raise type(exc)(f"{item.label}: {exc}") from exc
            if divisor != 1:
                engine.tensors.divide(item.target, divisor)
        return Outcome(write, agreement.first_nonfinite(payloads))
