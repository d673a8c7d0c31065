"""Semi-synchronous training (DiLoCo, Streaming DiLoCo, SparseLoCo): the outer loop as one more
binding of the step engine (:class:`deepreduce.collective.step.StepEngine`).

Each worker trains with its own inner optimizer; every ``sync_every`` (H) inner steps it reduces
its pseudo-gradient ``Δ = θ_global − θ_local`` (float32) over the group of workers through a
deepreduce config and its aggregation (allgather of containers, the sparse all-reduce, ``auto``),
averaged; the outer optimizer (over the model's parameters, as torchft's) steps with
``grad = mean Δ`` from ``θ_global``, and every worker continues from the new ``θ_global``. The
spec: ALGORITHMS.md IV.1-2; usage and recipes: docs/semisync.md.

With ``fragments=P`` the parameters are cut into P contiguous fragments that sync at staggered
steps (:mod:`deepreduce.collective.fragments`); with ``delay=τ`` a fragment's reduction is
submitted at its sync step (encoded and started on the engine's worker), finished and applied τ
inner steps later, mixed as ``θ ← α·θ_local + (1 − α)·θ_global``. One fragment is in flight at a
time, so each reduction is one engine step: ``begin`` (agreement), ``submit`` (the fragment's
items, :mod:`deepreduce.torch.diloco_items`: over torch.distributed one item whose parts are the
fragment's parameters, over Horovod one item per parameter, with ``flat=True`` the fragment as one
tensor), ``finish`` (decide, average, commit or undo the residuals, raise on every rank).

A model sharded by FSDP2 is synchronised shard by shard over ``group``, the ranks holding the
same shard on other nodes (:mod:`deepreduce.torch.diloco_shards`).

A reduction that fails (a peer's error, ``nonfinite: raise``) raises on every worker; the
fragment's global parameters, outer optimizer state and residuals stay as before, and its local
parameters are reset to the global ones. Under ``nonfinite: propagate`` the NaN reaches the outer
optimizer and ``stats()["nonfinite_propagated"]`` counts it.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..collective import sync_period
from ..collective.fragments import split
from ..collective.step import StepEngine
from ..errors import ConfigError
from . import diloco_state
from .arguments import build_pipeline
from .diloco_arguments import OWNER, check_flat, check_optimizers, trainable
from .diloco_dcp import DiLoCoCheckpoint
from .diloco_items import fragment_items
from .diloco_outer import outer_step, pseudo_gradient
from .diloco_period import PROBE_STEPS, schedule_or_auto
from .diloco_shards import check_sharded, local, local_numel
from .diloco_state import InFlight, agreed_layout
from .diloco_transport import open_transport
from .tensors import TorchTensors


class DiLoCo:
    """The outer loop around ``model`` trained by ``inner_optimizer`` (see the module docstring).

    ``outer_optimizer``: a torch optimizer over the model's trainable parameters, e.g.
    ``SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)`` (DiLoCo) or ``SGD(..., lr=1)``
    (plain averaging, SparseLoCo). ``compression``: a deepreduce config (name, YAML path, dict) or
    pipeline; None: lossless. ``group``: the workers' process group (``backend="torch"``, None: the
    default group) or Horovod process set (``backend="horovod"``). ``alpha``: the local parameters'
    weight when a fragment is applied. ``background``: encode and start the collectives on the
    engine's worker thread (False: inline; same bytes). ``flat``: send each fragment as one flat
    tensor (one container per shard and phase; :mod:`deepreduce.torch.diloco_items`).

    ``sync_every="auto"``: the workers time ``auto_probe_steps`` inner steps, probe the link and
    the config's codec, and rank 0 chooses H among ``auto_candidates`` within ``auto_slack`` of the
    compute (:mod:`deepreduce.torch.diloco_period`; ``auto_inputs`` gives figures instead of
    measuring them); no outer step happens before, the first is at the first multiple of H after.

    Building it is collective over ``group``: the workers agree on the layout and schedule, and
    every worker's model takes the first worker's parameters, the first global parameters.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer, outer_optimizer, sync_every,
                 compression=None, group=None, fragments: int = 1, delay: int = 0, alpha: float = 0.0,
                 backend: str = "torch", background: bool = True, path: str = "auto",
                 auto_candidates=sync_period.CANDIDATES, auto_slack: float = sync_period.DEFAULT_SLACK,
                 auto_probe_steps: int = PROBE_STEPS, auto_inputs: Optional[dict] = None, flat: bool = False) -> None:
        self.named = trainable(model)
        check_optimizers(inner_optimizer, outer_optimizer, [p for _, p in self.named])
        check_sharded(self.named, backend, group)
        check_flat(flat)
        self.inner, self.outer = inner_optimizer, outer_optimizer
        self.pipeline = build_pipeline(compression, path, spare_buffers=False)
        self.period, self.schedule = schedule_or_auto(sync_every, self.pipeline, fragments, delay, alpha,
                                                      auto_candidates, auto_slack, auto_probe_steps, auto_inputs)
        fragments = self.schedule.fragments if self.schedule is not None else self.period.fragments
        self.groups = split([local(p).numel() for _, p in self.named], fragments, OWNER)
        self.communicator, allreduce, self._broadcast, self._release = open_transport(backend, group, OWNER)
        self.layout = "flat" if flat else "bundled" if backend == "torch" else "per_parameter"
        self.engine = StepEngine(self.pipeline, self.communicator, TorchTensors(), allreduce, average=True,
                                 background=background, allreduce_averages=False, worker="deepreduce-diloco")
        self.device = self.named[0][1].device
        self.deltas: List[Optional[torch.Tensor]] = [None] * len(self.groups)   # see delta_buffer
        self.step_count = 0                      # inner steps counted
        self.rounds = [0] * len(self.groups)     # reductions submitted per fragment
        self.outer_steps = 0                     # reductions applied
        self.last_applied: Optional[int] = None  # the fragment the last of them updated
        self.in_flight: Optional[InFlight] = None
        self._hook = None
        try:
            self._agree()
            if self.period is not None:   # every worker agreed on the config: all raise alike
                self.period.check_priceable()
            with torch.no_grad():
                for name, p in self.named:
                    self._broadcast(local(p).data, name)
        except Exception:
            self._release()
            raise
        self.globals = [local(p).detach().to(torch.float32, copy=True) for _, p in self.named]
        if self.period is not None:
            self.period.restart(self.step_count)

    def _agree(self) -> None:
        """The engine's agreement: parameters, config, schedule, outer optimizer and inner step
        equal on every worker, or the same CommunicationError on each."""
        self.engine.begin(agreed_layout(self), OWNER)
        self._agreed = True

    # ------------------------------------------------------------------ the loop
    def __enter__(self) -> "DiLoCo":
        """Count ``inner_optimizer.step()`` calls (a post-step hook) and sync every H of them."""
        if self._hook is not None:
            raise ConfigError(f"{OWNER}: already entered; use one `with` block at a time")
        self._hook = self.inner.register_step_post_hook(lambda *_: self.step())
        return self

    def __exit__(self, kind, value, traceback) -> None:
        """Remove the hook; on a normal exit, wait for a reduction in flight (applied when due)."""
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()
        if kind is None:
            self.wait()

    def step(self) -> None:
        """After each inner optimizer step (the context manager calls it): count it, apply a
        fragment whose reduction is due, submit a fragment whose sync step this is."""
        if not self._agreed:
            self._agree()
        self.step_count += 1
        if self.schedule is None:   # sync_every="auto", H not chosen yet: time the step
            if self.period.tick(self.step_count):
                self._choose_period()
            return
        if self.in_flight is not None and self.in_flight.due <= self.step_count:
            self._apply()
        fragment = self.schedule.syncing(self.step_count)
        if fragment is not None:
            self._submit(fragment)
            if self.schedule.delay == 0:
                self._apply()

    def _choose_period(self) -> None:
        """Collective: measure, let rank 0 choose H, adopt it on every worker and agree again."""
        self.period.decide(self.communicator.inner, local_numel(self.named))
        self.schedule = self.period.schedule()
        self._agree()

    def delta_buffer(self, fragment: int) -> torch.Tensor:
        """The fragment's float32 Δ buffer: allocated when its reduction is submitted and dropped
        once it is applied, so between outer steps a worker keeps no Δ (its persistent state is
        θ_global, the compressor's and the outer optimizer's)."""
        if self.deltas[fragment] is None:
            self.deltas[fragment] = torch.empty(local_numel(self.named, self.groups[fragment]),
                                                dtype=torch.float32, device=self.device)
        return self.deltas[fragment]

    def _parts(self, fragment: int):
        """(name, parameter, global copy, Δ view) of each parameter of ``fragment``."""
        at, out, delta = 0, [], self.delta_buffer(fragment)
        for i in self.groups[fragment]:
            name, p = self.named[i]
            numel = local(p).numel()
            out.append((name, p, self.globals[i], delta[at:at + numel]))
            at += numel
        return out

    def _submit(self, fragment: int) -> None:
        parts = self._parts(fragment)
        pseudo_gradient(parts)
        round_ = self.rounds[fragment]
        self.rounds[fragment] += 1
        for item in fragment_items(self.layout, fragment, round_, self.delta_buffer(fragment), parts, self.pipeline.core):
            self.engine.submit(item)
        self.in_flight = InFlight(fragment, self.step_count + self.schedule.delay, round_)

    def wait(self) -> None:
        """Finish the reduction in flight, if any (collective): its mean Δ is kept until its due
        step. A failure raises here, on every worker (see the module docstring)."""
        flight = self.in_flight
        if flight is None or flight.finished:
            return
        parts = self._parts(flight.fragment)
        try:
            self.engine.finish(flight.round, [name for name, _, _, _ in parts])
        except Exception:
            self.in_flight, self.deltas[flight.fragment] = None, None
            with torch.no_grad():
                for _, p, g, _ in parts:
                    local(p).copy_(g.view_as(local(p)))
            raise
        flight.finished = True

    def _apply(self) -> None:
        """The outer optimizer's step on the fragment in flight, then the mix into the model."""
        self.wait()
        fragment, self.in_flight = self.in_flight.fragment, None
        outer_step(self.outer, [p for _, p in self.named], self._parts(fragment), self.schedule.alpha)
        self.deltas[fragment] = None
        self.outer_steps += 1
        self.last_applied = fragment

    # ------------------------------------------------------------------ statistics, checkpoints, life
    def stats(self) -> dict:
        """The engine's figures and the outer loop's (:func:`deepreduce.torch.diloco_state.stats`)."""
        return diloco_state.stats(self)

    def state_dict(self) -> dict:
        """The outer state (collective while a reduction is in flight: it is finished first):
        global parameters, outer optimizer state, compressor state (residuals, the sparse
        all-reduce's), schedule, inner step, rounds, the finished reduction awaiting its due step,
        byte counters. Save the model's and inner optimizer's state beside it."""
        self.wait()
        return diloco_state.save(self)

    def distributed_checkpoint(self) -> DiLoCoCheckpoint:
        """This rank's state as a DCP Stateful (:mod:`deepreduce.torch.diloco_dcp`)."""
        return DiLoCoCheckpoint(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (a DiLoCo built alike; an ``"auto"`` checkpoint
        brings its chosen H, so nothing is measured again); the workers agree again (on the
        restored inner step too) before the next outer step."""
        self.engine.idle()
        diloco_state.load(self, state)
        self._agreed = False

    def close(self) -> None:
        """Wait for a reduction in flight, then stop the engine's worker thread and release the
        private process group (in that order). Collective: call it on every worker at the end."""
        try:
            self.wait()
        finally:
            self.engine.close()
            release, self._release = self._release, lambda: None
            release()


__all__ = ["DiLoCo"]
