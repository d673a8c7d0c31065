"""The per-step bookkeeping the step engine (:mod:`deepreduce.collective.step`) and the TF
graph route share, framework-free:

* the route a tensor takes this step (:meth:`ReductionProtocol.route`: the ``auto`` plan's choice
  or the config's aggregation) and the residual flush of a tensor sent dense
  (:meth:`ReductionProtocol.take_residual`);
* for TF's allgather graph ops, which decide in a later op: the receive-side verdict on gathered
  containers (:meth:`ReductionProtocol.report`, with :meth:`ReductionProtocol.decide`, the
  ``nonfinite`` policy's reading of a flagged container);
* the end of a step (:meth:`ReductionProtocol.end_step`): commit or undo every residual the step
  touched (the pipeline's and the sparse all-reduce's owner residuals), the ``auto`` plan's turn,
  and the step's first error raised on every rank.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import CommunicationError, DeepReduceError
from ..pipeline import Pipeline
from ..wire import container
from . import agreement, failure

Found = Tuple[int, int, int]   # (rank, NaN count, Inf count) of a non-finite container
FINE, FAILED_REPORT = (-1, 0, 0), (-2, 0, 0)   # what report() says of a tensor to decode / of a failed one


class ReductionProtocol:
    """The protocol of one pipeline over one communicator (see the module docstring).

    ``average``: divide sums by the number of ranks (``op=Average``). ``sparse`` is the sparse
    all-reduce when the config's ``aggregation`` asks for it, else None (allgather); ``auto`` the
    planner of ``aggregation: auto`` (:mod:`deepreduce.collective.auto`), else None.
    """

    def __init__(self, core: Pipeline, communicator, average: bool = True) -> None:
        self.core, self.communicator, self.average = core, communicator, average
        aggregation = core.aggregation
        self.sparse = None if aggregation is None else aggregation.reducer(core, communicator)
        self.auto = None if aggregation is None else aggregation.planner(core, communicator)
        self._skipped: Dict[int, List[Tuple[str, Found]]] = {}
        self._failed: Dict[int, List[Tuple[str, BaseException]]] = {}

    # ------------------------------------------------------------------ route
    def route(self, name: str) -> str:
        """How ``name`` travels this step: the ``auto`` plan's choice (dense, fp16, allgather or
        sparse_allreduce), else the config's aggregation."""
        if self.auto is not None:
            return self.auto.choice(name)
        return "allgather" if self.sparse is None else "sparse_allreduce"

    def take_residual(self, name: str) -> Optional[np.ndarray]:
        """``name``'s error-feedback residual, cleared (None when it holds nothing): a tensor the
        ``auto`` plan moved to a dense or fp16 all-reduce sends what compression had held back,
        so the binding adds it to the gradient. The residual is saved first: a step that raises
        puts it back (:meth:`end_step`)."""
        self.core.save_state(name)
        return self.core.memory.take(name)

    # ------------------------------------------------------------------ receive
    @classmethod
    def split_per_rank(cls, payloads: Sequence, count: int, label: str, step: int) -> List[list]:
        """Every rank's payload of ``count`` concatenated containers (a bucket), split into its
        containers (a device tensor into device slices, no copy). A peer's
        :func:`~deepreduce.collective.failure.payload` raises here ; a rank that sent another
        number of containers is a CommunicationError naming it."""
        failure.raise_if_failed(payloads, label, step)
        per_rank = [container.split(payload) for payload in payloads]
        for rank, parts in enumerate(per_rank):
            if len(parts) != count:
                raise CommunicationError(f"{label}: rank {rank} sent {len(parts)} containers, expected {count}")
        return per_rank

    def report(self, payloads: Sequence, name: str, step: int) -> Found:
        """The receive-side decision for one tensor, for adapters that decode in a later op
        (TensorFlow): :data:`FAILED_REPORT` when a rank sent :func:`~deepreduce.collective.failure.payload` (the error is
        recorded, :meth:`end_step` raises it), a non-finite container's (rank, NaN, Inf) (recorded
        as :meth:`skip`), else :data:`FINE`. Only the first two skip the decode."""
        try:
            failure.raise_if_failed(payloads, name, step)
        except DeepReduceError as exc:
            self.fail(name, step, exc)
            return FAILED_REPORT
        found = self.decide(payloads)
        if found is None:
            return FINE
        self.skip(name, step, found)
        return found

    def fail(self, name: str, step: int, error: BaseException) -> None:
        """Record ``error`` of ``name`` at ``step`` (the same on every rank): :meth:`end_step` raises it."""
        self._failed.setdefault(step, []).append((name, error))

    # ------------------------------------------------------------------ decide, decode, average
    def decide(self, payloads: Sequence) -> Optional[Found]:
        """The first non-finite container among every rank's (only under ``nonfinite: raise``)."""
        return agreement.first_nonfinite(payloads) if self.core.nonfinite == "raise" else None

    def skip(self, name: str, step: int, found: Found) -> None:
        """Record that ``name`` of ``step`` came with a non-finite container (every rank sees it)."""
        self._skipped.setdefault(step, []).append((name, found))

    # ------------------------------------------------------------------ commit or undo
    def end_step(self, step: int, errors: Sequence[BaseException] = (),
                 order: Optional[Sequence[str]] = None) -> None:
        """After the step's last collective: commit the residual changes, or undo them when the
        step failed or was skipped, and raise the step's first error (``errors``, then those
        recorded by :meth:`fail`, the first tensor in ``order`` first), or the same
        NonFiniteGradientError on every rank, naming the first skipped tensor in ``order``."""
        skipped, failed = self._skipped.pop(step, []), self._failed.pop(step, [])
        self._skipped.clear()   # a step that failed before its end left its entry
        self._failed.clear()
        rank_of = {name: i for i, name in enumerate(order or ())}
        failed.sort(key=lambda entry: rank_of.get(entry[0], len(rank_of)))
        errors = list(errors) + [error for _, error in failed]
        if errors or skipped:
            self.core.undo_step()
            if self.sparse is not None:
                self.sparse.undo()
        else:
            self.core.commit_step()
            if self.sparse is not None:
                self.sparse.commit()
            self._plan(step)
        if errors:
            raise errors[0]
        if skipped:
            skipped.sort(key=lambda entry: rank_of.get(entry[0], len(rank_of)))
            name, found = skipped[0]
            raise agreement.nonfinite_error(name, step, *found, more=len(skipped) - 1)

    def _plan(self, step: int) -> None:
        """The ``auto`` planner's turn after a step every rank completed (collective); rank 0
        prints a new plan's table."""
        table = None if self.auto is None else self.auto.end_step(step)
        if table is not None and self.communicator.rank == 0:
            print(f"deepreduce auto aggregation, after step {step}:\n{table}", flush=True)

    # ------------------------------------------------------------------ statistics, checkpoints
    def stats(self) -> dict:
        """What the aggregation adds to ``compression_stats()``: its id and the bytes the sparse
        all-reduce received per phase; the ``auto`` plan's choices."""
        out = {}
        if self.sparse is not None:
            out.update(aggregation=self.core.aggregation.id, received_bytes=dict(self.sparse.received_bytes))
        if self.auto is not None:
            out.update(self.auto.stats())
        return out
