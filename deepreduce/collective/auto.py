"""The ``auto`` aggregation at run time: measure, agree, plan per bucket, re-plan on drift.

The planner (:mod:`deepreduce.collective.planner`) is a pure function of its inputs. This module
gathers those inputs during training and makes every rank use the same ones:

* the **backward timeline**: when each tensor (or bucket) became ready and when backward ended,
  recorded by the adapter's hooks (:meth:`AutoPlanner.ready`, :meth:`AutoPlanner.backward_done`);
* the **codec costs** of the config, measured on this machine by
  :func:`deepreduce.collective.cost_probe.measure_codec_costs` (small sizes: a fraction of a second);
* the **link**: the config's ``bandwidth_gbit`` and ``latency_us``, or, with ``bandwidth_gbit: 0``,
  a short probe that times allgathers of a few sizes through the communicator;
* the **host costs**: a rank's CPU beyond the codec (a float32 pass, the hand-over to the
  engine's worker, each collective call and received byte, the transport's own threads), timed
  through the communicator at this N by every rank together
  (:func:`deepreduce.collective.cost_probe.measure_collective_costs`, :func:`~deepreduce.collective.cost_probe.measure_host_costs`),
  so that a route's extra collectives and passes count in its predicted time.

Rank 0's measurements are the plan's inputs on every rank (one allgather of their bytes), so
every rank computes the same plan. Until the first plan (after the first step) every tensor
travels by allgather. Every ``replan_every`` steps the inputs are measured again and the plan is
rebuilt when any predicted time moved by more than ``drift`` (:func:`planner.needs_replan`).
"""
from __future__ import annotations

import time
from typing import Dict, Optional

from ..errors import ConfigError
from . import planner
from .agreement import unwrap_bytes, wrap_bytes
from .cost_model import HostCosts, Link

PROBE_BYTES = (1 << 12, 1 << 16, 1 << 20, 1 << 22)   # allgather sizes of the link probe
PROBE_SIZES = (1 << 14, 1 << 16, 1 << 18)          # tensor sizes of the codec-cost probe
HOST_BYTES = (1 << 10, 1 << 16, 1 << 19)           # payload bytes of the host-cost probe's collectives
HOST_BUSY_S = 0.2                                   # seconds it times the transport's threads beside work


class AutoPlanner:
    """The ``auto`` aggregation of one pipeline over one communicator (see the module docstring)."""

    def __init__(self, settings, pipeline, communicator) -> None:
        ratio = getattr(pipeline.sparsifier, "ratio", None)
        if not isinstance(ratio, float):
            raise ConfigError(f"aggregation 'auto' plans the config's codecs from its sparsifier's ratio; "
                              f"sparsifier {pipeline.sparsifier.id!r} has none")
        self.settings, self.pipeline, self.communicator = settings, pipeline, communicator
        self.plan: Optional[planner.Plan] = None
        self.inputs: Optional[planner.PlanInputs] = None
        self._choices: Dict[str, str] = {}
        self._ready: Dict[str, float] = {}
        self._numels: Dict[str, int] = {}
        self._backward_end: Optional[float] = None
        self.replans = 0

    # ------------------------------------------------------------------ the adapter's hooks
    def ready(self, name: str, numel: int) -> None:
        """Tensor (or bucket) ``name`` of ``numel`` elements is ready for reduction now."""
        self._ready[name] = time.perf_counter()
        self._numels[name] = int(numel)

    def restart_timeline(self) -> None:
        """Forget the tensors (or buckets) recorded so far: a new step begins whose set of names
        may differ (DDP rebuilds its buckets after the first step)."""
        self._ready.clear()
        self._numels.clear()
        self._backward_end = None

    def backward_done(self) -> None:
        """Backward has ended (the adapter starts waiting for the step's reductions)."""
        self._backward_end = time.perf_counter()

    def choice(self, name: str) -> str:
        """How ``name`` travels this step: dense, fp16, allgather or sparse_allreduce."""
        return self._choices.get(name, planner.ALLGATHER)

    def end_step(self, step: int) -> Optional[str]:
        """After a step every rank completed: plan after the first, re-plan every
        ``replan_every`` steps if the inputs drifted. Collective: every rank calls it at the same
        step. Returns the plan table when a (new) plan was made, else None."""
        due = self.plan is None or (self.settings.replan_every and step % self.settings.replan_every == 0)
        if not due or not self._ready:
            return None
        inputs = self._agreed_inputs()
        if self.plan is not None and not planner.needs_replan(self.inputs, inputs, self.settings.drift):
            return None
        self.inputs, self.plan = inputs, planner.plan(inputs)
        self._choices = {name: choice.aggregation for name, choice in self.plan.choices().items()}
        self.replans += 1
        return planner.format_plan(self.plan)

    # ------------------------------------------------------------------ measuring and agreeing
    def _agreed_inputs(self) -> planner.PlanInputs:
        """Rank 0's inputs on every rank (the link probe, if any, runs on every rank together;
        rank 0's fit is the one its inputs carry)."""
        link = self._link()
        host = self._host_costs() if self.settings.host_costs else None
        mine = b""
        if self.communicator.rank == 0:
            mine = self._measured_inputs(link, host).to_bytes()
        payloads = self.communicator.allgather(wrap_bytes(mine), "deepreduce.auto.plan")
        return planner.PlanInputs.from_bytes(unwrap_bytes(payloads[0]))

    def _link(self) -> Link:
        s = self.settings
        if s.bandwidth_gbit > 0:
            return Link.from_gbit(s.bandwidth_gbit, s.latency_us * 1e-6)
        return probe_link(self.communicator)

    def _host_costs(self) -> Optional[HostCosts]:
        """Collective: every rank times the communicator's collectives together; rank 0 adds its
        float32 pass and hand-over (its figures are the plan's). None on one rank."""
        from .cost_probe import measure_collective_costs, measure_host_costs

        rank, size = self.communicator.rank, self.communicator.size
        if size < 2:
            return None
        comm = self.communicator   # it carries containers: each probe payload travels wrapped in one
        collective = measure_collective_costs(
            lambda payload, name: comm.allgather(wrap_bytes(payload.tobytes()), name),
            lambda payloads, name: comm.alltoall([wrap_bytes(p.tobytes()) for p in payloads], name),
            rank, size, sizes=sorted({max(b, size) for b in HOST_BYTES}), repeat=3, busy_s=HOST_BUSY_S)
        if rank != 0:
            return None
        return measure_host_costs(collective, repeat=3, note="measured by the auto aggregation at run time")

    def _measured_inputs(self, link: Link, host: Optional[HostCosts] = None) -> planner.PlanInputs:
        from .cost_probe import measure_codec_costs

        end = self._backward_end if self._backward_end is not None else max(self._ready.values())
        names = sorted(self._ready)
        buckets = planner.buckets_from_timeline(names, [self._numels[n] for n in names],
                                                [self._ready[n] for n in names], end)
        config = {k: v for k, v in self.pipeline.get_config().items() if k not in ("communicator", "aggregation")}
        costs = measure_codec_costs(config, name="config", sizes=PROBE_SIZES, repeat=3, threads=self.pipeline.threads,
                                    clock="wall", note="measured by the auto aggregation at run time")
        return planner.PlanInputs(buckets, self.communicator.size, link, (costs,), host=host)

    def stats(self) -> dict:
        """What ``compression_stats()`` reports: each tensor's choice and how often it planned."""
        return {"plan": dict(self._choices), "plans_made": self.replans}


def probe_link(communicator) -> Link:
    """The alpha-beta link fitted to allgathers of :data:`PROBE_BYTES` through ``communicator``
    (each timed three times, the fastest kept): ``(N-1) alpha + (N-1) p / B`` per rank."""
    from .linear_fit import fit_nonnegative

    ranks = communicator.size
    if ranks < 2:   # nothing crosses a link
        return Link(0.0, 1e18)
    seconds = []
    for nbytes in PROBE_BYTES:
        payload = wrap_bytes(b"\1" * nbytes)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            communicator.allgather(payload, f"deepreduce.auto.probe{nbytes}")
            best = min(best, time.perf_counter() - start)
        seconds.append(best)
    alpha, inverse_bandwidth = fit_nonnegative(
        [[float(ranks - 1)] * len(PROBE_BYTES), [float((ranks - 1) * b) for b in PROBE_BYTES]],
        seconds, "probe seconds")
    return Link(float(alpha), 1.0 / max(float(inverse_bandwidth), 1e-18))
