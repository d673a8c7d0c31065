"""The sync period H as the planner's third choice, beside codec and collective.

Semi-synchronous training (DiLoCo and its successors) reduces one pseudo-gradient every ``H``
inner steps instead of a gradient every step. The DiLoCo papers' wall-clock model: an inner step
costs its compute ``c``; every ``H`` steps a rank also pays the outer reduction of the whole
model, ``S = encode + comm + decode`` (:mod:`deepreduce.collective.cost_model` prices each
collective). Streaming DiLoCo overlaps the transfer with the next ``delay`` inner steps, so only
``max(0, comm - delay c)`` of the link time is exposed; encode and decode run on the same cores as
the compute and stay exposed. Per inner step::

    T(H) = c + (encode + max(0, comm - delay c) + decode) / H

Fragments (P parts synchronised at staggered steps) send ``1/P`` of the model ``P`` times per
period: the same bytes per inner step, ``P`` times fewer at once, so the exposed link time is
``P max(0, comm/P - delay c)`` per period (the alpha terms are ignored at these sizes).

A larger ``H`` costs quality (the workers drift apart between syncs; DiLoCo's H = 500 is the
far end), so :func:`choose` returns the *smallest* candidate whose predicted step time is within
``slack`` of the compute alone (the link is then nearly hidden), and among configs and
collectives the one that reaches it at the smallest H, then the fastest. Every figure is a pure
function of its inputs, as :mod:`deepreduce.collective.planner` needs to agree across ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from ..errors import ConfigError
from .cost_model import (
    FLOAT16_BYTES,
    FLOAT32_BYTES,
    CodecCosts,
    Cost,
    Link,
    allgather_cost,
    check_nonnegative,
    check_ranks,
    dense_cost,
    sparse_allreduce_cost,
)

#: The periods the planner tries, smallest first (DiLoCo's 500 is the largest the papers run).
CANDIDATES = (1, 2, 5, 10, 20, 30, 50, 100, 200, 500)
#: What the outer reduction may add to an inner step's compute, as a fraction of it.
DEFAULT_SLACK = 0.05
#: Dense outer reductions: name -> bytes per element (int8: a per-tensor scale is ignored).
DENSE_ITEMSIZE = {"dense": FLOAT32_BYTES, "bf16": FLOAT16_BYTES, "int8": 1}
CODED = ("allgather", "sparse_allreduce")


@dataclass(frozen=True)
class OuterOption:
    """One way to reduce the pseudo-gradient: a dense all-reduce (``dense``, ``bf16``, ``int8``)
    or a deepreduce config through ``allgather`` / ``sparse_allreduce``."""

    aggregation: str
    codec: Optional[CodecCosts] = None

    def __post_init__(self) -> None:
        if self.aggregation in DENSE_ITEMSIZE:
            if self.codec is not None:
                raise ConfigError(f"sync period: {self.aggregation} takes no codec")
        elif self.aggregation in CODED:
            if self.codec is None:
                raise ConfigError(f"sync period: {self.aggregation} needs a codec's costs")
        else:
            raise ConfigError(f"sync period: unknown aggregation {self.aggregation!r}; known: "
                              f"{', '.join((*DENSE_ITEMSIZE, *CODED))}")

    @property
    def label(self) -> str:
        if self.codec is None:
            return self.aggregation
        return f"{'ag' if self.aggregation == 'allgather' else 'sa'}:{self.codec.name}"

    def cost(self, link: Link, ranks: int, numel: float) -> Cost:
        """One rank's cost of one outer reduction of ``numel`` parameters."""
        if self.codec is None:
            return dense_cost(link, ranks, numel, DENSE_ITEMSIZE[self.aggregation])
        if self.aggregation == "allgather":
            return allgather_cost(link, ranks, numel, self.codec)
        return sparse_allreduce_cost(link, ranks, numel, self.codec)


@dataclass(frozen=True)
class Prediction:
    """What one (option, H) costs per inner step."""

    option: str
    sync_every: int
    step_s: float
    outer_s: float
    sent_bits_per_param: float          # per inner step, this rank's sent bits / parameters
    received_bits_per_param: float


def exposed_outer_s(cost: Cost, compute_s: float, delay: int = 0, fragments: int = 1) -> float:
    """Seconds one period's outer reduction adds to the step time (see the module docstring)."""
    if fragments < 1 or delay < 0:
        raise ConfigError(f"sync period: fragments must be >= 1 and delay >= 0, got {fragments}, {delay}")
    hidden = delay * compute_s
    link = fragments * max(0.0, cost.comm_s / fragments - hidden)
    return cost.encode_s + link + cost.decode_s


def predict(option: OuterOption, link: Link, ranks: int, numel: float, compute_s: float, sync_every: int,
            delay: int = 0, fragments: int = 1) -> Prediction:
    """Step time and bits per parameter per inner step of ``option`` synchronising every ``sync_every``."""
    check_ranks(ranks)
    check_nonnegative(compute_s, "sync period compute_s")
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ConfigError(f"sync period: sync_every must be an integer >= 1, got {sync_every!r}")
    if not numel > 0:
        raise ConfigError(f"sync period: numel must be > 0, got {numel!r}")
    cost = option.cost(link, ranks, numel)
    outer = exposed_outer_s(cost, compute_s, delay, fragments)
    per_step = 8.0 / (numel * sync_every)
    return Prediction(option.label, sync_every, compute_s + outer / sync_every, outer,
                      cost.sent_bytes * per_step, cost.received_bytes * per_step)


def choose(options: Sequence[OuterOption], link: Link, ranks: int, numel: float, compute_s: float,
           candidates: Sequence[int] = CANDIDATES, slack: float = DEFAULT_SLACK, delay: int = 0,
           fragments: int = 1) -> Prediction:
    """The (option, H) with the smallest H whose step time is within ``slack`` of ``compute_s``,
    the fastest among those; if no candidate gets there, the fastest at the largest candidate."""
    if not options or not candidates:
        raise ConfigError("sync period: choose needs at least one option and one candidate H")
    check_nonnegative(slack, "sync period slack")
    budget = compute_s * (1.0 + slack)
    for h in sorted(candidates):
        fits = [p for p in (predict(o, link, ranks, numel, compute_s, h, delay, fragments) for o in options)
                if p.step_s <= budget]
        if fits:
            return min(fits, key=lambda p: p.step_s)
    h = max(candidates)
    return min((predict(o, link, ranks, numel, compute_s, h, delay, fragments) for o in options),
               key=lambda p: p.step_s)


def table(options: Sequence[OuterOption], link: Link, ranks: int, numel: float, compute_s: float,
          candidates: Sequence[int] = CANDIDATES, delay: int = 0, fragments: int = 1) -> List[Prediction]:
    """Every (option, H) prediction, option-major: what ``bench-scaling --sync-every`` prints."""
    return [predict(o, link, ranks, numel, compute_s, h, delay, fragments) for o in options for h in candidates]
