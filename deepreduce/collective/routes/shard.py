"""The compressed reduce-scatter (FSDP's ``reduce_scatter`` comm): the first phase of the sparse
all-reduce, ended at the owner.

Each rank's flat input is N equal chunks, rank-major (chunk ``j`` goes to rank ``j``). The rank
compensates and selects once over the whole input and encodes one container per chunk with the
config's codecs (:func:`deepreduce.collective.shards.encode_shards`, the sparse all-reduce's phase one); one alltoall
carries chunk ``j``'s container to rank ``j`` (its own stays local), and the owner decode-sums
the N containers of its chunk into the item's target, in float32 and in gloo's order
(:func:`ring_order`), written in the target's dtype.

Scaling: the engine's divisor (1 for a binding that does not average), then the collective's own
``op`` that the binding passes as ``item.key`` (:class:`Scaling`): FSDP's reduce op is part of
the collective's contract (AVG divides the sum by N, PreMulSum multiplies it by its factor), as
Horovod's op is part of the Dense route's all-reduce. With lossless codecs the result equals
gloo's ``reduce_scatter_tensor`` bit for bit for float32 buffers on any number of ranks (the same
additions in the same order), and for bfloat16 buffers on two ranks (one addition per element; a
division by N or a multiplication by a power of two commutes with the final rounding to
bfloat16); with more ranks gloo rounds every partial sum of a bf16 buffer to bf16, while this
route sums in float32 and rounds once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ...errors import CommunicationError, DeepReduceError
from .. import agreement, failure, ports, shards
from ..sparse_allreduce import even_bounds
from ._base import Outcome, Route


@dataclass(frozen=True)
class Scaling:
    """What the collective's reduce op asks of the sum: divide it by ``divide`` (AVG: the group
    size) and/or multiply it by ``multiply`` (PreMulSum's factor); None: leave it."""

    divide: Optional[int] = None
    multiply: Optional[float] = None

    def apply(self, total: np.ndarray) -> None:
        if self.divide not in (None, 1):
            np.divide(total, np.float32(self.divide), out=total)
        if self.multiply is not None:
            np.multiply(total, np.float32(self.multiply), out=total)


def ring_order(owner: int, size: int) -> list:
    """The ranks whose chunks the owner sums, in the order gloo's reduce-scatter adds them: from
    ``owner - 1`` down (mod ``size``) to the owner itself, one float32 addition after another.
    Measured on torch 2.13's gloo (3 to 6 ranks, 8e3 to 1.2e6 elements, SUM and AVG, AVG being
    the sum divided by ``size``): summing in this order makes a lossless config equal FSDP's own
    reduce-scatter bit for bit on any number of ranks, not only on two (where every order is the
    same). NCCL's ring adds in an order of its own; there the results agree within rounding."""
    return [(owner - 1 - i) % size for i in range(size)]


class Shard(Route):
    id = "shard"
    ORDER = 1   # collectives in a fixed order (alltoall), after those Horovod matches by name

    def __init__(self, engine) -> None:
        self.engine = engine

    @staticmethod
    def _bounds(engine, item) -> np.ndarray:
        numel, size = engine.tensors.numel(item.grad), engine.communicator.size
        if numel % size:
            raise CommunicationError(f"{item.label}: a reduce-scatter input of {numel} elements does not "
                                     f"split into {size} equal chunks")
        if engine.tensors.numel(item.target) * size != numel:
            raise CommunicationError(f"{item.label}: the output holds {engine.tensors.numel(item.target)} "
                                     f"elements, the input's chunk {numel // size}")
        return even_bounds(numel, size)

    def start(self, engine, item):
        bounds = self._bounds(engine, item)
        payloads = shards.encode_shards(engine.core, engine.tensors.host(item.grad), item.name, item.step, bounds)
        return ports.start_alltoall(engine.communicator, payloads, f"deepreduce.shard.{item.name}")

    def fail(self, engine, item, error):
        payloads = [failure.payload(error)] * engine.communicator.size
        return ports.start_alltoall(engine.communicator, payloads, f"deepreduce.shard.{item.name}")

    def finish(self, engine, item, pending):
        mine = pending.wait()
        if len(mine) != engine.communicator.size:
            raise CommunicationError(f"{item.label}: {len(mine)} chunks for {engine.communicator.size} ranks")
        failure.raise_if_failed(mine, item.label, item.step)
        chunk = engine.tensors.numel(item.target)
        scaling = item.key if isinstance(item.key, Scaling) else Scaling()

        order = ring_order(engine.communicator.rank, len(mine))

        def write(divisor: int) -> None:
            try:
                total = engine.core.decode_sum([mine[r] for r in order], expected_shape=(chunk,)).reshape(-1)
            except DeepReduceError as exc:
                raise type(exc)(f"{item.label} (containers summed from rank {order[0]} down to this rank "
                                f"{order[-1]}; 'rank k' above counts in that order): {exc}") from exc
            if divisor != 1:
                np.divide(total, np.float32(divisor), out=total)
            scaling.apply(total)
            engine.tensors.write(item.target, total)
        return Outcome(write, agreement.first_nonfinite(mine))
