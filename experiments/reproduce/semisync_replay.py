"""The arithmetic of ``deepreduce reproduce semisync``: training records, measured times, wall clock.

Pure functions over the JSON the two phases write, so that they are tested without a network:

* :func:`merge_ranks`: the ranks' records of one training run -> one record: the messages of each
  step (per call, the kind of collective and the largest ``bytes_in`` over the ranks, which is
  what the slowest transfer carries), bytes sent and received per rank, outer steps;
* :func:`representatives`: the message sizes the time phase measures per kind of collective
  (every distinct size when there are few, else evenly spaced quantiles with both ends);
* :class:`Transfer`: the measured seconds of a message, interpolated piecewise linearly in bytes
  between the measured sizes of its kind (exact at them);
* :func:`wall_clock`: the wall time after each step (see its docstring for the overlap);
* :func:`time_to_reach`: the wall time of the first evaluation at or below a loss.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

Message = Tuple[str, int]


def merge_ranks(ranks: Sequence[dict]) -> dict:
    """One run's record from its ranks' results (the curve is rank 0's: it is every rank's sum)."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    first = ranks[0]
    n_steps = len(first["steps"])
    if any(len(r["steps"]) != n_steps for r in ranks):
        raise ValueError(f"semisync: ranks of {first['method']} recorded different numbers of steps")
    messages: List[List[List]] = []
    for k in range(n_steps):
        per_rank = [r["steps"][k] for r in ranks]
        calls = max(len(c) for c in per_rank)
        step = []
        for i in range(calls):
            present = [c[i] for c in per_rank if i < len(c)]
            step.append([present[0][0], max(int(c[1]) for c in present)])
        messages.append(step)
    sent = [sum(int(c[1]) for step in r["steps"] for c in step) for r in ranks]
    received = [sum(int(c[2]) for step in r["steps"] for c in step) for r in ranks]
    return {"method": first["method"], "world": len(ranks), "parameters": first["parameters"],
            "curve": first["curve"], "messages": messages, "sent_bytes": sent, "received_bytes": received,
            "outer_steps": sum(1 for step in messages if step), "steps": n_steps,
            "stats": [r.get("stats", {}) for r in ranks]}


def bits_per_parameter_step(nbytes: float, parameters: int, steps: int) -> float:
    """Bits per parameter per inner step of ``nbytes`` over ``steps`` steps."""
    return 8.0 * nbytes / parameters / max(1, steps)


def distinct_messages(records: Iterable[dict]) -> Dict[str, List[int]]:
    """``{op: sorted distinct sizes}`` over every step of every record."""
    sizes: Dict[str, set] = defaultdict(set)
    for record in records:
        for step in record["messages"]:
            for op, nbytes in step:
                sizes[op].add(int(nbytes))
    return {op: sorted(s) for op, s in sorted(sizes.items())}


def representatives(sizes: Sequence[int], limit: int) -> List[int]:
    """At most ``limit`` (>= 2) of ``sizes`` to measure: all of them if few, else quantiles with both ends."""
    sizes = sorted(set(int(s) for s in sizes))
    if len(sizes) <= limit:
        return sizes
    picks = np.unique(np.round(np.linspace(0, len(sizes) - 1, limit)).astype(int))
    return [sizes[i] for i in picks]


class Transfer:
    """Seconds of a message over one link, from the time phase's ``[[op, bytes, seconds], ...]``."""

    def __init__(self, measured: Sequence[Sequence]) -> None:
        points: Dict[str, List[Tuple[int, float]]] = defaultdict(list)
        for op, nbytes, seconds in measured:
            points[op].append((int(nbytes), float(seconds)))
        self.points = {op: (np.array([b for b, _ in sorted(p)], dtype=np.float64),
                            np.array([s for _, s in sorted(p)], dtype=np.float64)) for op, p in points.items()}

    def seconds(self, op: str, nbytes: int) -> float:
        if op not in self.points:
            raise KeyError(f"semisync: no measured time for collective {op!r}")
        sizes, times = self.points[op]
        if len(sizes) == 1:
            return float(times[0] * (nbytes / sizes[0] if sizes[0] else 1.0))
        if nbytes > sizes[-1]:      # past the largest measured: the last segment's slope
            slope = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
            return float(times[-1] + slope * (nbytes - sizes[-1]))
        return float(np.interp(nbytes, sizes, times))

    def step(self, messages: Sequence[Sequence]) -> float:
        """Seconds of one step's messages, one after the other (as the ranks issue them)."""
        return sum(self.seconds(op, int(nbytes)) for op, nbytes in messages)


def compute_times(profile_steps: Sequence[Sequence]) -> Dict[str, float]:
    """``{"plain": s, "synced": s}``: median seconds of a step without and with messages.

    From the profile's ``[[seconds, synced], ...]`` (slowest rank per step); a kind that was not
    seen takes the other's time (a DDP row communicates every step).
    """
    plain = [s for s, synced in profile_steps if not synced]
    synced = [s for s, synced in profile_steps if synced]
    if not plain and not synced:
        raise ValueError("semisync: an empty profile")
    out = {"plain": statistics.median(plain) if plain else statistics.median(synced),
           "synced": statistics.median(synced) if synced else statistics.median(plain)}
    return out


def wall_clock(messages: Sequence[Sequence], compute: Dict[str, float], transfer: Transfer,
               delay: int = 0) -> List[float]:
    """Wall-clock seconds after each step (index ``k``: after step ``k + 1``).

    A step computes for ``compute["synced"]`` when it sends, else ``compute["plain"]`` (both
    measured on loopback: forward, backward, optimizer, the codec and a loopback transfer). Its
    messages then occupy the link one after the other, starting when the link is free. With
    ``delay == 0`` the step waits for them (DDP hooks, a blocking outer step). With ``delay = d``
    (Streaming DiLoCo's overlap) the next ``d`` steps compute while they travel, and step
    ``k + d`` waits for them before it finishes (it applies the result); the link carries one
    message at a time, so a transfer that outlasts ``d`` steps delays the next outer step.
    """
    clock, link_free, due, out = 0.0, 0.0, [], []
    for k, step in enumerate(messages):
        clock += compute["synced" if step else "plain"]
        if step:
            start = max(clock, link_free)
            link_free = start + transfer.step(step)
            if delay <= 0:
                clock = link_free
            else:
                due.append((k + delay, link_free))
        while due and due[0][0] <= k:
            clock = max(clock, due.pop(0)[1])
        out.append(clock)
    return out


def time_to_reach(curve: Sequence[dict], clock: Sequence[float], target: float) -> Optional[float]:
    """Wall time of the first evaluation at or below ``target`` (None: never reached)."""
    for point in curve:
        if point["step"] > 0 and point["val_loss"] <= target:
            return clock[point["step"] - 1]
    return None


def mean_spread(values: Sequence[float]) -> Tuple[float, float]:
    """``(mean, half the range)`` of ``values`` (the spread over seeds)."""
    values = [float(v) for v in values]
    return float(np.mean(values)), (max(values) - min(values)) / 2.0
