"""``aggregation: auto``: pick, per bucket, the codec and the aggregation that minimise the
predicted step time, from inputs every rank agrees on.

The timeline (after Espresso, Wang et al., EuroSys'23): backward produces the buckets one after
another; bucket ``i`` is ready ``hide_s`` seconds before backward ends (the backward compute still
to come after it, behind which its reduction can hide). One rank reduces its buckets one at a
time, in the order they become ready, each taking the alternative's ``Cost.total_s`` (encode,
collectives, decode: :mod:`deepreduce.collective.cost_model`): bucket ``i`` starts at
``max(ready_i, end_{i-1})``. What the step pays for communication is ``max(0, end_last)``,
measured from the end of backward: the *exposed* time.

Choosing the fastest alternative for every bucket minimises every end time, so it minimises the
exposed time (each end is non-decreasing in the previous one). Among choices with that same
optimal exposed time the planner prefers the least lossy one wherever the bucket has slack:
``dense``, then ``fp16``, then the compressed alternatives fastest first. So a bucket whose
reduction hides behind later backward compute is sent dense (compression gains it nothing),
``auto`` is never predicted slower than any fixed choice nor than dense all-reduce, and ties
break the same way on every rank.

Every rank must plan from the same inputs: rank 0 measures (link probe, codec costs), broadcasts
:meth:`PlanInputs.to_bytes`, every rank calls :func:`plan` on :meth:`PlanInputs.from_bytes` of it.
The arithmetic is IEEE float arithmetic in a fixed order, so the plans are identical.
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import ConfigError
from .cost_model import (
    COLLECTIVES,
    FLOAT16_BYTES,
    CodecCosts,
    Cost,
    HostCosts,
    Link,
    allgather_cost,
    check_nonnegative,
    check_ranks,
    dense_cost,
    host_seconds,
    sparse_allreduce_cost,
    step_cpu_s,
)

DENSE, FP16, ALLGATHER, SPARSE_ALLREDUCE = "dense", "fp16", "allgather", "sparse_allreduce"
#: Every aggregation the planner knows, in order of preference when they tie.
AGGREGATIONS = (DENSE, FP16, ALLGATHER, SPARSE_ALLREDUCE)
CODED = (ALLGATHER, SPARSE_ALLREDUCE)
#: Relative change of a predicted bucket time above which :func:`needs_replan` says re-plan.
DEFAULT_DRIFT = 0.25
#: Seconds of float rounding tolerated when a slower alternative is checked against a bucket's slack.
SLACK_TOLERANCE_S = 1e-9
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Bucket:
    """One bucket of gradients as the planner sees it.

    Attributes:
        name: the bucket's name (its first gradient's, as :mod:`deepreduce.collective.buckets` names it).
        numel: its elements.
        hide_s: backward compute remaining when the bucket is ready, in seconds (0: ready last).
    """

    name: str
    numel: int
    hide_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"bucket name must be a non-empty string, got {self.name!r}")
        if isinstance(self.numel, bool) or not isinstance(self.numel, numbers.Integral) or self.numel < 1:
            raise ConfigError(f"bucket {self.name}: numel must be an integer >= 1, got {self.numel!r}")
        object.__setattr__(self, "numel", int(self.numel))
        object.__setattr__(self, "hide_s", check_nonnegative(self.hide_s, f"bucket {self.name} hide_s"))


@dataclass(frozen=True)
class Choice:
    """One way to reduce a bucket: an aggregation, and for the coded ones the config's name."""

    aggregation: str
    codec: Optional[str] = None

    @property
    def label(self) -> str:
        return self.aggregation if self.codec is None else f"{self.aggregation}:{self.codec}"


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan depends on; equal inputs give equal plans on every rank.

    Attributes:
        buckets: the buckets, in any order (the plan orders them by readiness).
        ranks: the number of ranks N.
        link: the alpha-beta link model.
        codecs: measured costs of the configs the coded aggregations may use.
        aggregations: the aggregations allowed (a subset of :data:`AGGREGATIONS`).
        host: the rank's host CPU beyond the codec (:class:`~deepreduce.collective.cost_model.HostCosts`),
            added to every alternative's cost; None: codec and link only.
    """

    buckets: Tuple[Bucket, ...]
    ranks: int
    link: Link
    codecs: Tuple[CodecCosts, ...] = ()
    aggregations: Tuple[str, ...] = AGGREGATIONS
    host: Optional[HostCosts] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "buckets", tuple(self.buckets))
        object.__setattr__(self, "codecs", tuple(self.codecs))
        object.__setattr__(self, "aggregations", tuple(self.aggregations))
        check_ranks(self.ranks)
        if not self.buckets:
            raise ConfigError("plan inputs: buckets must not be empty")
        if len({b.name for b in self.buckets}) != len(self.buckets):
            raise ConfigError("plan inputs: bucket names must be distinct")
        unknown = [a for a in self.aggregations if a not in AGGREGATIONS]
        if unknown or not self.aggregations:
            raise ConfigError(f"plan inputs: aggregations must be some of {AGGREGATIONS}, got {self.aggregations}")
        if len({c.name for c in self.codecs}) != len(self.codecs):
            raise ConfigError("plan inputs: codec names must be distinct")
        if not alternatives(self):
            raise ConfigError("plan inputs: no alternative (coded aggregations need codec costs)")
        if self.host is not None and not isinstance(self.host, HostCosts):
            raise ConfigError(f"plan inputs: host must be HostCosts or None, got {type(self.host).__name__}")

    def to_dict(self) -> dict:
        """A plain dict of plain values (JSON-ready); :meth:`from_dict` rebuilds equal inputs
        (``host`` only where the inputs carry host costs)."""
        out = {"version": FORMAT_VERSION, "ranks": self.ranks, "link": self.link.to_dict(),
               "buckets": [[b.name, b.numel, b.hide_s] for b in self.buckets],
               "codecs": [c.to_dict() for c in self.codecs], "aggregations": list(self.aggregations)}
        if self.host is not None:
            out["host"] = self.host.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "PlanInputs":
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            raise ConfigError(f"plan inputs: expected a dict of version {FORMAT_VERSION}")
        try:
            buckets = [Bucket(name, numel, hide) for name, numel, hide in data["buckets"]]
            return cls(buckets=tuple(buckets), ranks=data["ranks"], link=Link.from_dict(data["link"]),
                       codecs=tuple(CodecCosts.from_dict(c) for c in data["codecs"]),
                       aggregations=tuple(data["aggregations"]),
                       host=None if data.get("host") is None else HostCosts.from_dict(data["host"]))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"plan inputs: malformed dict ({type(exc).__name__}: {exc})") from exc

    def to_bytes(self) -> bytes:
        """Canonical UTF-8 JSON of :meth:`to_dict` (floats written so they read back exactly)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_bytes(cls, payload: bytes) -> "PlanInputs":
        try:
            data = json.loads(bytes(payload).decode())
        except (UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(f"plan inputs: not the bytes of PlanInputs.to_bytes ({exc})") from exc
        return cls.from_dict(data)


@dataclass(frozen=True)
class BucketPlan:
    """One bucket's decision: the choice, the predicted cost of every alternative, and when its
    reduction runs (seconds relative to the end of backward; negative: before it ends)."""

    bucket: Bucket
    choice: Choice
    costs: Tuple[Tuple[Choice, Cost], ...]
    start_s: float
    end_s: float

    def cost(self, choice: Optional[Choice] = None) -> Cost:
        """The predicted cost of ``choice`` (default: the chosen one)."""
        wanted = choice or self.choice
        return next(cost for alt, cost in self.costs if alt == wanted)


@dataclass(frozen=True)
class Plan:
    """The planner's output: one :class:`BucketPlan` per bucket, in the order they become ready,
    and the communication time the step is predicted to expose after backward."""

    ranks: int
    buckets: Tuple[BucketPlan, ...]
    exposed_s: float
    fixed: Optional[Choice] = None

    def choices(self) -> Dict[str, Choice]:
        """Bucket name -> choice: what the protocol looks up per bucket."""
        return {b.bucket.name: b.choice for b in self.buckets}


# ---------------------------------------------------------------------------- the model
def alternatives(inputs: PlanInputs) -> List[Choice]:
    """Every choice the inputs allow, in tie-break order (dense, fp16, then coded by codec name)."""
    out = [Choice(a) for a in (DENSE, FP16) if a in inputs.aggregations]
    for aggregation in CODED:
        if aggregation in inputs.aggregations:
            out += [Choice(aggregation, c.name) for c in sorted(inputs.codecs, key=lambda c: c.name)]
    return out


def choice_cost(choice: Choice, numel: int, inputs: PlanInputs) -> Cost:
    """The cost model's prediction for one bucket of ``numel`` elements reduced by ``choice``
    (with the inputs' host costs, :func:`~deepreduce.collective.cost_model.host_seconds`, where they carry them)."""
    cost = _link_and_codec_cost(choice, numel, inputs)
    if inputs.host is None:
        return cost
    host = host_seconds(inputs.host, choice.aggregation, numel, cost.received_bytes, COLLECTIVES[choice.aggregation])
    return replace(cost, host_s=host)


def _link_and_codec_cost(choice: Choice, numel: int, inputs: PlanInputs) -> Cost:
    link, ranks = inputs.link, inputs.ranks
    if choice.aggregation == DENSE:
        return dense_cost(link, ranks, numel)
    if choice.aggregation == FP16:
        return dense_cost(link, ranks, numel, FLOAT16_BYTES)
    codec = next((c for c in inputs.codecs if c.name == choice.codec), None)
    if codec is None:
        raise ConfigError(f"choice {choice.label}: no codec costs named {choice.codec!r}")
    if choice.aggregation == ALLGATHER:
        return allgather_cost(link, ranks, numel, codec)
    return sparse_allreduce_cost(link, ranks, numel, codec)


def step_cpu(choice: Choice, numels: Sequence[int], inputs: PlanInputs, compute_s: float = 0.0) -> float:
    """A rank's predicted CPU seconds of one engine step reducing tensors of ``numels`` elements by
    ``choice`` after ``compute_s`` of forward and backward: :func:`choice_cost` of each tensor,
    combined by :func:`~deepreduce.collective.cost_model.step_cpu_s` (needs the inputs' host costs)."""
    if inputs.host is None:
        raise ConfigError("step_cpu needs plan inputs with host costs (HostCosts)")
    costs = [choice_cost(choice, int(n), inputs) for n in numels]
    return step_cpu_s(costs, choice.aggregation, inputs.host, compute_s)


def ready_order(buckets: Sequence[Bucket]) -> List[int]:
    """Bucket positions in the order backward makes them ready (most hide first; ties: as given)."""
    return sorted(range(len(buckets)), key=lambda i: (-buckets[i].hide_s, i))


def exposed_seconds(hides: Sequence[float], durations: Sequence[float]) -> float:
    """Communication exposed after backward when buckets ready ``hides[i]`` seconds before its
    end (in ready order) are reduced one at a time, each taking ``durations[i]`` seconds."""
    end = -math.inf
    for hide, duration in zip(hides, durations):
        end = max(-hide, end) + duration
    return max(0.0, end)


def plan(inputs: PlanInputs, fixed: Optional[Choice] = None) -> Plan:
    """The per-bucket plan minimising the exposed communication (see the module docstring).

    ``fixed``: reduce every bucket with this one choice instead (the simulator's fixed rows).
    """
    order = ready_order(inputs.buckets)
    buckets = [inputs.buckets[i] for i in order]
    options = [fixed] if fixed is not None else alternatives(inputs)
    costs = [tuple((alt, choice_cost(alt, b.numel, inputs)) for alt in options) for b in buckets]
    fastest = [min(cost.total_s for _, cost in row) for row in costs]
    # latest end of each bucket that keeps the optimal exposed time (backward from the last one)
    latest = [0.0] * len(buckets)
    latest[-1] = exposed_seconds([b.hide_s for b in buckets], fastest)
    for i in range(len(buckets) - 2, -1, -1):
        latest[i] = latest[i + 1] - fastest[i + 1]
    planned, end = [], -math.inf
    for bucket, row, fast, limit in zip(buckets, costs, fastest, latest):
        start = max(-bucket.hide_s, end)
        ranked = sorted(enumerate(row), key=lambda item: (_preference(item[1][0]), item[1][1].total_s, item[0]))
        choice, cost = next(((alt, cost) for _, (alt, cost) in ranked
                             if start + cost.total_s <= limit + SLACK_TOLERANCE_S),
                            next((alt, cost) for alt, cost in row if cost.total_s == fast))
        end = start + cost.total_s
        planned.append(BucketPlan(bucket, choice, row, start, end))
    return Plan(inputs.ranks, tuple(planned), max(0.0, end), fixed)


def _preference(choice: Choice) -> int:
    """Lossless first, then half precision, then the coded alternatives (ordered by speed)."""
    return {DENSE: 0, FP16: 1}.get(choice.aggregation, 2)


# ---------------------------------------------------------------------------- re-planning, printing
def drift(old: PlanInputs, new: PlanInputs) -> float:
    """Largest relative change of any bucket's predicted time for any alternative between two
    sets of inputs (``inf`` when the buckets, ranks or alternatives differ)."""
    if [(b.name, b.numel) for b in old.buckets] != [(b.name, b.numel) for b in new.buckets] \
            or old.ranks != new.ranks or alternatives(old) != alternatives(new):
        return math.inf
    worst = 0.0
    for bucket in old.buckets:
        for alt in alternatives(old):
            before = choice_cost(alt, bucket.numel, old).total_s
            after = choice_cost(alt, bucket.numel, new).total_s
            if before != after:
                worst = max(worst, abs(after - before) / max(before, after))
    for before, after in zip(old.buckets, new.buckets):
        if before.hide_s != after.hide_s:
            worst = max(worst, abs(after.hide_s - before.hide_s) / max(before.hide_s, after.hide_s))
    return worst


def needs_replan(old: PlanInputs, new: PlanInputs, threshold: float = DEFAULT_DRIFT) -> bool:
    """Whether freshly measured inputs moved any prediction by more than ``threshold`` (relative)."""
    if check_nonnegative(threshold, "needs_replan threshold") == 0:
        raise ConfigError("needs_replan threshold must be > 0")
    return drift(old, new) > threshold


def format_plan(result: Plan) -> str:
    """One table: bucket, elements, hide ms, choice, then predicted ms of every alternative
    (``Cost.total_s``; ``*`` marks the choice), and the exposed communication per step."""
    labels = [alt.label for alt, _ in result.buckets[0].costs]
    width = max(10, *(len(label) for label in labels))
    name_width = max(6, *(len(b.bucket.name) for b in result.buckets))
    header = f"{'bucket':<{name_width}} {'numel':>11} {'hide_ms':>8} {'choice':<{width}} " + \
        " ".join(f"{label:>{width}}" for label in labels)
    lines = [f"plan for {result.ranks} ranks: predicted ms of each alternative per bucket", header, "-" * len(header)]
    for b in result.buckets:
        cells = " ".join(f"{1e3 * cost.total_s:>{width - 1}.3f}{'*' if alt == b.choice else ' '}"
                         for alt, cost in b.costs)
        lines.append(f"{b.bucket.name:<{name_width}} {b.bucket.numel:>11} {1e3 * b.bucket.hide_s:>8.2f} "
                     f"{b.choice.label:<{width}} {cells}")
    lines.append(f"exposed communication after backward: {1e3 * result.exposed_s:.3f} ms")
    return "\n".join(lines)


def buckets_from_timeline(names: Sequence[str], numels: Sequence[int], ready_s: Sequence[float],
                          backward_end_s: float) -> Tuple[Bucket, ...]:
    """Buckets from measured times: each ready at ``ready_s[i]``, backward ending at
    ``backward_end_s`` (one clock); a bucket ready after that end hides nothing."""
    if not len(names) == len(numels) == len(ready_s):
        raise ConfigError("buckets_from_timeline: names, numels and ready_s must have equal lengths")
    return tuple(Bucket(name, numel, max(0.0, float(backward_end_s) - float(ready)))
                 for name, numel, ready in zip(names, numels, ready_s))
