"""The step engine: one owner of a training step, whichever binding feeds it.

A binding (the Horovod optimizer, the DDP hook, FSDP's comms, the TF tape's host op; next an
outer loop) says where gradients come from and plugs in two ports (:mod:`deepreduce.collective.ports`):
how bytes move (a communicator with ``allgather_async`` / ``alltoall_async``, plus an
``allreduce``) and how to read and write its tensors. Everything else happens here, once:

* :meth:`StepEngine.begin`: the ranks agree on the layout and compressor before the first
  collective (:mod:`deepreduce.collective.agreement`);
* :meth:`StepEngine.submit`: an item is ready; the plan picks its route
  (:mod:`deepreduce.collective.routes`) and the route's ``start`` (select, encode, first
  collective) runs on the engine's one background worker while backward goes on (or inline,
  ``background=False``: same bytes). An error there sends the failure payload instead
  (:mod:`deepreduce.collective.failure`), so every rank stays in phase;
* :meth:`StepEngine.finish`: in one canonical order on every rank (route order, then name), each
  route's middle phases (per item, then for all of a route's items at once where the route shares
  collectives among them: the sparse all-reduce's one alltoall per step), then its last wait; then the one decision (the ``nonfinite`` policy:
  ``propagate`` writes the NaN/Inf and counts it in :meth:`stats`; ``raise`` writes nothing for the
  step), one divisor for averaging, commit or undo of every residual the step touched (the
  pipeline's and the routes'), and the step's first error raised on every rank.

Why one worker thread: the pipeline's per-tensor state (residuals, statistics) is touched by one
encode at a time, in submission order; the C++ kernels and large NumPy passes release the GIL, so
encodes overlap backward where the rank has a core to spare.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from . import agreement, failure, overlap, ports, totals
from .protocol import ReductionProtocol
from .routes import registry
from .worker import Worker

PHASES = ("encode", "encode_hidden", "encode_wait", "communication_wait", "decode")


@dataclass(eq=False)
class Item:
    """One tensor (or bucket) of a step. ``grad``: the binding's tensor to send; ``target``: where
    the reduced result goes (often ``grad`` itself); ``label`` names it in errors; ``written``
    (optional) runs after the result was written, e.g. a bucket copying its slices back;
    ``replace`` (optional) takes a new tensor where the result cannot be written in place (a
    sparse gradient's entries); ``summed_dense``: the binding lets its framework's all-reduce sum
    it (a small tensor, :func:`deepreduce.collective.routes.dense.summed_dense`).

    ``parts``: (name, tensor, out) of each container the item travels as, encoded from ``tensor``
    and written into ``out`` (a pair (name, tensor): written into the tensor; default: ``grad``
    into ``target`` under ``name``); a DDP bucket of many parameters
    sends one container per parameter in one collective. ``header``: what a transport that checks
    each collective sends ahead of the payload (the DDP hook's slots,
    :class:`deepreduce.collective.slots.Header`), or None. ``timeline``: the ``auto`` planner
    records when the item became ready (not on DDP's first step, whose buckets are rebuilt)."""

    name: str
    step: int
    grad: Any
    target: Any = None
    label: str = ""
    key: Any = None
    summed_dense: bool = False
    written: Optional[Callable[[], None]] = None
    replace: Optional[Callable[[Any], None]] = None
    parts: Optional[List[tuple]] = None
    header: Any = None
    timeline: bool = True
    route: str = ""
    started: Any = None
    error: Optional[BaseException] = None
    span: tuple = field(default=(0.0, 0.0))

    def __post_init__(self):
        self.target = self.grad if self.target is None else self.target
        self.label = self.label or f"tensor {self.name!r}"
        self.parts = [(p[0], p[1], p[-1]) for p in (self.parts or [(self.name, self.grad, self.target)])]

    def part_label(self, name: str) -> str:
        """A part in errors: the item's label when it is one part, else the parameter's name."""
        return self.label if len(self.parts) == 1 else f"parameter {name!r}"


class StepEngine:
    """One step of one pipeline (or summable compressor) over one group (see the module docstring).

    ``codec``: the binding's pipeline (``encode(grad, name=, step=)``, ``decode_sum(payloads,
    expected_shape=, out=)`` and ``core``, the framework-free :class:`~deepreduce.pipeline.Pipeline`),
    or None with ``compressor`` (a Horovod-style summable compressor). ``communicator``:
    allgather / alltoall transport; ``allreduce(tensor, item, average) -> handle`` with
    ``wait()``: the binding's all-reduce (sum, or average where ``average`` and
    ``allreduce_averages``; a binding whose all-reduce only sums passes False, and the summable
    route divides the decompressed sum); ``tensors``: the binding's tensor port. ``average``:
    divide sums by the number of ranks. ``worker``: the background thread's name (the default is
    the name the Horovod optimizer's worker has always had).
    """

    def __init__(self, codec, communicator, tensors, allreduce: Callable, *, average: bool = True,
                 background: bool = True, compressor=None, allreduce_averages: bool = True,
                 worker: str = "deepreduce-step_0") -> None:
        self.codec, self.compressor = codec, compressor
        self.core = None if codec is None else getattr(codec, "core", codec)   # a binding pipeline, or the core itself
        self.communicator, self.tensors, self.allreduce = communicator, tensors, allreduce
        self.average, self.allreduce_averages = average, allreduce_averages
        self.protocol = None if codec is None else ReductionProtocol(self.core, communicator, average=average)
        self.auto = None if self.protocol is None else self.protocol.auto
        self.routes = {rid: cls(self) for rid, cls in registry().items()}
        self.background = bool(background)
        self.worker = Worker(worker)
        self._pending: List[tuple] = []
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.nonfinite_propagated = 0   # tensors written with NaN/Inf under nonfinite: propagate
        self.routes_taken: Dict[str, int] = {}             # route -> items it carried
        self.routes_by_name: Dict[str, Dict[str, int]] = {}   # tensor -> route -> times

    # ------------------------------------------------------------------ the step
    def begin(self, layout: agreement.Layout, who: str) -> None:
        """Collective, once per layout (the binding calls it before its first item and after the
        layout changed): every rank compares ``layout`` in one small allgather; a mismatch is the
        same CommunicationError on every rank, naming the first difference."""
        agreement.agree(layout, lambda payload: self.communicator.allgather(payload, "deepreduce.collective.agreement"), who)

    def submit(self, item: Item) -> None:
        """``item`` is ready: its route's ``start`` runs on the worker (or now, inline)."""
        if self.auto is not None and self.compressor is None and not item.summed_dense and item.timeline \
                and not self.tensors.is_sparse(item.grad):
            self.auto.ready(item.name, self.tensors.numel(item.grad))
        future: Future
        if self.background:
            future = self.worker.submit(self._start, item)
        else:
            future = Future()
            future.set_result(self._start(item))
        self._pending.append((item, future))

    def _start(self, item: Item) -> Item:
        began = time.perf_counter()
        item.route = self._route_of(item)
        route = self.routes[item.route]
        try:
            item.started = route.start(self, item)
        except Exception as exc:   # noqa: BLE001 (every peer must hear of it: the failure payload goes instead)
            item.started = None
            if failure.on_every_rank(exc):   # every rank raised it at the same collective: nothing follows
                item.error = item.error or exc
            else:
                self.caught(item, exc)
                try:
                    item.started = route.fail(self, item, exc)
                except Exception:   # noqa: BLE001 (its own error is the one to report)
                    item.started = None
        item.span = (began, time.perf_counter())
        return item

    @staticmethod
    def caught(item: Item, exc: BaseException) -> None:
        """Keep ``exc``, raised while starting ``item`` on this rank: the rank raises it at
        :meth:`finish` (its first one, over what its peers' failure payloads say)."""
        exc.add_note(f"deepreduce: raised while encoding {item.label} at step {item.step}")
        if item.error is None:
            item.error = exc

    def gather(self, item: Item, payload):
        """Start the allgather of ``item``'s ``payload`` (with its header where it has one)."""
        if item.header is None:
            return ports.start_allgather(self.communicator, payload, f"deepreduce.{item.name}")
        return self.communicator.allgather_async(payload, f"deepreduce.{item.name}", header=item.header)

    def _route_of(self, item: Item) -> str:
        """The plan: how ``item`` travels this step (a route id of :func:`~deepreduce.collective.routes.registry`)."""
        if item.route:   # the binding fixed it (FSDP's reduce-scatter: "shard")
            return item.route
        if self.compressor is not None:
            return "summable"
        if self.tensors.is_sparse(item.grad):
            return "entries"
        if item.summed_dense:
            return "dense"
        return self.protocol.route(item.name)

    def finish(self, step: int, order: Sequence[str] = (), end: bool = True) -> None:
        """Wait for every submitted item and write its result, then decide, commit or undo and
        raise the step's first error (``order``: tensor names, the first named error first) or the
        same NonFiniteGradientError on every rank (see the module docstring). ``end=False`` (a
        binding that ends the step in an op of its own, TensorFlow's) records the errors and
        skips with the protocol instead, for its ``end_step``."""
        if self.auto is not None:
            self.auto.backward_done()
        self._finish(step, order, end)

    def finish_later(self, step: int, order: Sequence[str], then: Callable[[Optional[BaseException]], None]) -> None:
        """:meth:`finish` on the worker, after every item submitted so far has started (inline
        without a worker); ``then(error)`` runs after it (None: the step was applied). For a
        binding that must not block the thread that hands items over (DDP's comm hook)."""
        if self.auto is not None:
            self.auto.backward_done()   # now, when backward ended, not when the worker gets to it

        def run() -> None:
            try:
                self._finish(step, order, True)
            except Exception as exc:   # noqa: BLE001 (handed to the binding, which fails its futures)
                then(exc)
                return
            then(None)
        if self.background:
            self.worker.submit(run)
        else:
            run()

    def _finish(self, step: int, order: Sequence[str], end: bool) -> None:
        since = time.perf_counter()
        pending, self._pending = self._pending, []
        items = [future.result() for _, future in pending]
        self._account_encodes(items, since)
        items.sort(key=lambda it: (self.routes[it.route].ORDER, it.name))
        errors: List[tuple] = [(it.name, it.error) for it in items if it.error is not None]
        for it in items:
            self.routes_taken[it.route] = self.routes_taken.get(it.route, 0) + 1
            counts = self.routes_by_name.setdefault(it.name, {})
            counts[it.route] = counts.get(it.route, 0) + 1
            if it.started is not None:
                with totals.timed(self.seconds, "communication_wait"):
                    it.started = self._guarded(it, errors, self.routes[it.route].settle, it.started)
        for rid in dict.fromkeys(it.route for it in items):   # routes that share collectives among their items
            with totals.timed(self.seconds, "communication_wait"):
                self.routes[rid].settle_all(self, [it for it in items if it.route == rid and it.started is not None])
        for it in items:
            if it.started is None:   # failed on every rank at its start, or reported by settle
                continue
            with totals.timed(self.seconds, "communication_wait"):
                outcome = self._guarded(it, errors, self.routes[it.route].finish, it.started)
            if outcome is not None and it.error is None:
                self._decide(it, outcome, step, errors)
        if end:
            self._end(step, [error for _, error in errors], order)
        elif self.protocol is not None:
            for name, error in errors:
                self.protocol.fail(name, step, error)
        elif errors:
            raise errors[0][1]

    def _guarded(self, item: Item, errors: List[tuple], phase, started):
        """``phase(self, item, started)``; an error is kept as (name, error) and the next items are
        still finished (an item whose own encode raised keeps that error: what its own failure
        payload says of it is not kept)."""
        try:
            return phase(self, item, started)
        except Exception as exc:   # noqa: BLE001 (drain every collective before raising)
            if item.error is None:   # else its own failure payload speaking: its own error is kept
                errors.append((item.name, exc))
            return None

    def _decide(self, item: Item, outcome, step: int, errors: List[tuple]) -> None:
        """The one reader of the ``nonfinite`` policy; the one divisor for averaging."""
        if outcome.nonfinite is not None and self._raises_on_nonfinite():
            self.protocol.skip(outcome.part or item.name, step, outcome.nonfinite)
            return
        try:
            with totals.timed(self.seconds, "decode"):
                outcome.write(self.communicator.size if self.average else 1)
        except Exception as exc:   # noqa: BLE001
            errors.append((item.name, exc))
            return
        if outcome.nonfinite is not None:
            self.nonfinite_propagated += 1
        if item.written is not None:
            item.written()

    def _raises_on_nonfinite(self) -> bool:
        return self.core is not None and self.core.nonfinite == "raise"

    def _end(self, step: int, errors: List[BaseException], order: Sequence[str]) -> None:
        """Commit or undo every residual of the step and raise its first error; ``steps`` counts
        the steps applied."""
        try:
            if self.protocol is not None:
                self.protocol.end_step(step, errors, order)
            elif errors:
                raise errors[0]
        except Exception as exc:
            if failure.on_every_rank(exc):   # raised from the same frames on every rank, whatever its route
                raise exc.with_traceback(None)
            raise
        self.steps += 1

    def _account_encodes(self, items: List[Item], since: float) -> None:
        spans = [it.span for it in items]
        self.seconds["encode"] += sum(b - a for a, b in spans)
        if self.background:
            self.seconds["encode_hidden"] += overlap.covered_seconds(spans, [(-math.inf, since)])
        self.seconds["encode_wait"] += time.perf_counter() - since

    # ------------------------------------------------------------------ statistics, state, life
    def stats(self) -> dict:
        """Where the time went (every route's encode, communication and decode), the pipeline's
        bytes, the routes taken and the aggregation's figures."""
        out = {} if self.core is None else self.core.stats.as_dict()
        s = self.seconds
        out.update(encode_seconds=s["encode"], encode_hidden_seconds=s["encode_hidden"],
                   encode_wait_seconds=s["encode_wait"], communication_wait_seconds=s["communication_wait"],
                   steps=self.steps, background=self.background, nonfinite_propagated=self.nonfinite_propagated,
                   routes_taken=dict(self.routes_taken))
        if self.core is None:
            out.update(decode_seconds=s["decode"])
        if self.protocol is not None:
            out.update(self.protocol.stats())
        return out

    def idle(self) -> None:
        """Block until the worker has run everything handed to it."""
        self.worker.idle()

    def close(self) -> None:
        """Stop the worker (after the last step)."""
        self.worker.close()
