"""``DiLoCo(..., sync_every="auto")``: the workers measure what the model needs and choose the sync
period H with :func:`deepreduce.collective.sync_period.choose` (issue 33, item 5).

Before the first outer step the outer loop runs ``probe_steps`` inner steps without syncing and
measures the three inputs of the sync-period model:

* ``compute_s``: the median seconds between two inner steps on each worker (the time between two
  ``step()`` calls: forward, backward, the inner optimizer and the data), the slowest worker's;
* the link: :func:`deepreduce.collective.auto.probe_link` (allgathers of a few sizes through the
  outer loop's transport, an alpha-beta fit);
* the config's codec costs: :func:`deepreduce.collective.cost_probe.measure_codec_costs` on
  :data:`PROBE_SIZES` (about a second on a busy CPU), priced at the config's selection ratio (a
  ``chunk_topk`` of ``k`` per chunk at ``k / chunk``).

Rank 0 chooses (options: the config's aggregation, allgather or the sparse all-reduce, both for
``aggregation: auto``) and its decision (H and every input) reaches every worker in one
allgather, so every worker adopts the same H; the engine's agreement then compares the schedule
with H again, so workers that still differ fail together. The first sync is at the first multiple
of H after the probe. Collectives of the choice go through the uncounted transport, so the outer
loop's byte counters hold only the outer steps.

``inputs`` (the documented hook, for tests and for runs that know their figures): a dict with any
of ``compute_s`` (float seconds), ``link`` (:class:`~deepreduce.collective.cost_model.Link`) and
``codec`` (:class:`~deepreduce.collective.cost_model.CodecCosts`); a given input is used instead of
its measurement (rank 0's is the one that counts). A config whose sparsifier has no ratio (the
lossless default, a quantiser alone) cannot be priced by the probe: give ``codec`` then.
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Optional

from ..collective import sync_period
from ..collective.agreement import unwrap_bytes, wrap_bytes
from ..collective.cost_model import CodecCosts, Link, check_nonnegative
from ..collective.fragments import ALPHA, DELAY, FRAGMENTS, Schedule
from ..errors import ConfigError, quote
from .diloco_arguments import OWNER

PROBE_STEPS = 5
PROBE_SIZES = (1 << 14, 1 << 15, 1 << 16)     # tensor sizes of the codec-cost probe
NAME = "deepreduce.diloco.period"             # the collectives of the choice (not counted)
INPUTS = ("compute_s", "link", "codec")
DECISION_KEYS = ("sync_every", "option", "predicted_step_s", "outer_s", "sent_bits_per_parameter_per_inner_step",
                 "received_bits_per_parameter_per_inner_step", "compute_s", "compute_s_per_rank", "link", "codec",
                 "ranks", "parameters")


def priced_config(config: dict) -> Optional[dict]:
    """``config`` (less its communicator and aggregation) with its sparsifier's selection as a
    ``ratio`` (:func:`deepreduce.collective.cost_probe.with_ratio`), or None when it has none."""
    from ..collective.cost_probe import with_ratio

    config = with_ratio({k: v for k, v in config.items() if k not in ("communicator", "aggregation")})
    ratio = (config.get("sparsifier") or {}).get("ratio")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        return None
    return config


class AutoPeriod:
    """The choice of H of one DiLoCo (see the module docstring)."""

    def __init__(self, pipeline, fragments, delay, alpha, candidates, slack, probe_steps, inputs,
                 owner: str = "DiLoCo") -> None:
        self.owner = owner
        if isinstance(candidates, (str, bytes)) or not hasattr(candidates, "__iter__"):
            raise ConfigError(f"{owner}: auto_candidates must be a sequence of integers >= 1, got {quote(candidates)}")
        candidates = list(candidates)
        if not candidates or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in candidates):
            raise ConfigError(f"{owner}: auto_candidates must be a non-empty sequence of integers >= 1, "
                              f"got {quote(candidates)}")
        fragments = FRAGMENTS.check(owner, "fragments", fragments, "argument")
        delay = DELAY.check(owner, "delay", delay, "argument")
        alpha = ALPHA.check(owner, "alpha", alpha, "argument")
        self.candidates = sorted({h for h in candidates if self._fits(h, fragments, delay, alpha)})
        if not self.candidates:
            raise ConfigError(f"{owner}: no auto_candidates {sorted(candidates)} fits fragments={fragments} "
                              f"delay={delay} (each H needs fragments <= H and delay within the gap between syncs)")
        self.fragments, self.delay, self.alpha = fragments, delay, alpha
        self.slack = check_nonnegative(slack, f"{owner} auto_slack")
        if isinstance(probe_steps, bool) or not isinstance(probe_steps, int) or probe_steps < 1:
            raise ConfigError(f"{owner}: auto_probe_steps must be an integer >= 1, got {quote(probe_steps)}")
        self.probe_steps = probe_steps
        self.inputs = self._checked_inputs(inputs)
        self.aggregations = self._aggregations(pipeline)
        self.config = priced_config(pipeline.get_config())
        self.pipeline = pipeline
        self.decision: Optional[dict] = None
        self.restart(0)

    # ------------------------------------------------------------------ arguments
    @staticmethod
    def _fits(h, fragments, delay, alpha) -> bool:
        try:
            Schedule(h, fragments, delay, alpha)
        except ConfigError:
            return False
        return True

    def _checked_inputs(self, inputs) -> dict:
        if inputs is None:
            return {}
        if not isinstance(inputs, dict) or not set(inputs) <= set(INPUTS):
            raise ConfigError(f"{self.owner}: auto_inputs must be a dict with keys among {list(INPUTS)}, "
                              f"got {quote(inputs)}")
        if "compute_s" in inputs:
            check_nonnegative(inputs["compute_s"], f"{self.owner} auto_inputs['compute_s']")
        for key, cls in (("link", Link), ("codec", CodecCosts)):
            if key in inputs and not isinstance(inputs[key], cls):
                raise ConfigError(f"{self.owner}: auto_inputs[{key!r}] must be a {cls.__name__}, "
                                  f"got {type(inputs[key]).__name__}")
        return dict(inputs)

    def _aggregations(self, pipeline) -> tuple:
        aggregation = pipeline.core.aggregation
        if aggregation is None:
            return ("allgather",)
        if aggregation.id == "sparse_allreduce":
            return ("sparse_allreduce",)
        if aggregation.id == "auto":
            return sync_period.CODED
        raise ConfigError(f"{self.owner}: sync_every='auto' cannot price aggregation {aggregation.id!r}")

    def check_priceable(self) -> None:
        """A ConfigError when the config's codec cannot be measured and no costs were given
        (called after the workers agreed on the config, so every worker raises it)."""
        if self.config is None and "codec" not in self.inputs:
            raise ConfigError(f"{self.owner}: sync_every='auto' prices the pseudo-gradient's codec from the config's "
                              f"sparsifier ratio, and sparsifier {self.pipeline.core.sparsifier.id!r} has none; give "
                              "sync_every=H, or the codec's costs as auto_inputs={'codec': CodecCosts(...)}")

    def describe(self) -> str:
        """The requested choice in words, for the engine's agreement before H is chosen."""
        return (f"sync_every=auto candidates={self.candidates} slack={self.slack!r} probe_steps={self.probe_steps} "
                f"inputs given={sorted(self.inputs)} fragments={self.fragments} delay={self.delay} "
                f"alpha={self.alpha!r}")

    # ------------------------------------------------------------------ measuring
    def restart(self, step: int) -> None:
        """Begin (again) to time inner steps after inner step ``step``."""
        self.start_step = step
        self.seconds = []
        self._last = time.perf_counter()

    def tick(self, step: int) -> bool:
        """Inner step ``step`` ended: time it; True when the probe is complete."""
        now = time.perf_counter()
        self.seconds.append(now - self._last)
        self._last = now
        return step - self.start_step >= self.probe_steps

    def decide(self, communicator, numel: int) -> dict:
        """Collective over ``communicator`` (the uncounted transport): every worker's compute
        time, the link probe, rank 0's codec probe and choice; every worker returns rank 0's
        decision and adopts it."""
        from ..collective.auto import probe_link

        mine = statistics.median(self.seconds) if self.seconds else 0.0
        gathered = communicator.allgather(wrap_bytes(json.dumps(mine).encode()), f"{NAME}.compute")
        per_rank = [float(json.loads(unwrap_bytes(p).decode())) for p in gathered]
        link = self.inputs["link"] if "link" in self.inputs else probe_link(communicator)
        payload = b""
        if communicator.rank == 0:
            payload = json.dumps(self._choose(per_rank, link, communicator.size, numel)).encode()
        decision = json.loads(unwrap_bytes(communicator.allgather(wrap_bytes(payload), f"{NAME}.decision")[0]).decode())
        self.adopt(decision)
        return decision

    def _choose(self, per_rank, link: Link, ranks: int, numel: int) -> dict:
        from ..collective.cost_probe import measure_codec_costs

        compute = float(self.inputs.get("compute_s", max(per_rank)))
        codec = self.inputs.get("codec")
        if codec is None:
            codec = measure_codec_costs(self.config, name="config", sizes=PROBE_SIZES, repeat=3, threads=1,
                                        clock="wall", note="measured by DiLoCo(sync_every='auto') at run time")
        options = [sync_period.OuterOption(a, codec) for a in self.aggregations]
        pick = sync_period.choose(options, link, ranks, numel, compute, self.candidates, self.slack, self.delay,
                                  self.fragments)
        return {"sync_every": pick.sync_every, "option": pick.option, "predicted_step_s": pick.step_s,
                "outer_s": pick.outer_s, "sent_bits_per_parameter_per_inner_step": pick.sent_bits_per_param,
                "received_bits_per_parameter_per_inner_step": pick.received_bits_per_param, "compute_s": compute,
                "compute_s_per_rank": list(per_rank), "link": link.to_dict(), "codec": codec.to_dict(),
                "ranks": ranks, "parameters": numel}

    # ------------------------------------------------------------------ the decision
    def adopt(self, decision: dict) -> Schedule:
        """Keep ``decision`` (checked) and return the schedule of its H."""
        self.decision = self.checked(decision)
        return self.schedule()

    def schedule(self) -> Schedule:
        """The schedule of the chosen H."""
        return self.adopt_schedule(self.decision)

    def adopt_schedule(self, decision: dict) -> Schedule:
        """The schedule of ``decision``'s H (nothing kept)."""
        return Schedule(decision["sync_every"], self.fragments, self.delay, self.alpha, self.owner)

    def checked(self, decision) -> dict:
        """``decision`` if it is a decision of this choice (a checkpoint's, rank 0's); a
        ConfigError naming the field otherwise."""
        if not isinstance(decision, dict) or set(decision) != set(DECISION_KEYS):
            got = sorted(map(str, decision))[:8] if isinstance(decision, dict) else type(decision).__name__
            raise ConfigError(f"{self.owner}: a sync-period decision must have the keys {sorted(DECISION_KEYS)}, "
                              f"got {quote(got)}")
        h = decision["sync_every"]
        if isinstance(h, bool) or not isinstance(h, int) or h not in self.candidates:
            raise ConfigError(f"{self.owner}: the sync-period decision's sync_every {quote(h)} is not one of "
                              f"auto_candidates {self.candidates}")
        return dict(decision)


__all__ = ["AutoPeriod", "PROBE_STEPS", "priced_config"]


def schedule_or_auto(sync_every, pipeline, fragments: int, delay: int, alpha: float, candidates, slack: float,
                     probe_steps: int, inputs: Optional[dict]):
    """``(AutoPeriod, None)`` for ``sync_every="auto"``, ``(None, Schedule)`` for an integer H."""
    if isinstance(sync_every, str):
        if sync_every != "auto":
            raise ConfigError(f"{OWNER}: sync_every must be an integer >= 1 or 'auto', got {sync_every!r}")
        return AutoPeriod(pipeline, fragments, delay, alpha, candidates, slack, probe_steps, inputs, OWNER), None
    return None, Schedule(sync_every, fragments, delay, alpha, OWNER)
