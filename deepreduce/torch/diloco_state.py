"""The checkpoint of the outer loop (:class:`deepreduce.torch.diloco.DiLoCo`), checked on load.

``save(diloco)`` is a dict ``torch.save`` writes (and ``torch.load(weights_only=True)`` reads):
``format``, ``step`` (inner steps counted), ``schedule`` (sync_every, fragments, delay, alpha; None
while ``sync_every="auto"`` has not chosen H), ``sync_period`` (the auto choice's decision, H and
its measured inputs, so a resumed run does not measure again; None without one),
``rounds`` (reductions submitted per fragment), ``outer_steps``, ``globals`` (each parameter's
float32 global copy, by name), ``outer_optimizer`` (its ``state_dict()``, copied),
``compression`` (residuals and learned state; the sparse all-reduce's under ``aggregation``,
:func:`deepreduce.torch.checkpoint.compression_state_dict`), ``pending`` (None, or the finished
reduction that waits for its due step: fragment, due, round and its mean Δ) and ``bytes`` (sent,
received). ``load`` checks every field before it changes anything: a checkpoint of another
schedule, model or config is a ConfigError naming the field.
"""
from __future__ import annotations

import copy
import hashlib

import torch

from .. import checkpoint
from ..collective import agreement
from ..errors import ConfigError, quote
from .checkpoint import compression_state_dict, load_compression_state_dict
from .diloco_arguments import hyperparameters
from .diloco_shards import is_sharded, local, local_numel

FORMAT = 3   # 2: sync_period (the sync_every="auto" decision); 3: shards (which shard of each sharded parameter)
KEYS = ("format", "step", "schedule", "sync_period", "rounds", "outer_steps", "globals", "outer_optimizer", "compression",
        "pending", "bytes", "shards")
OWNER = "DiLoCo.load_state_dict"


class InFlight:
    """The fragment whose reduction was submitted (``round``): applied at inner step ``due``;
    ``finished``: its mean Δ is in the fragment's buffer."""

    def __init__(self, fragment: int, due: int, round_: int, finished: bool = False) -> None:
        self.fragment, self.due, self.round, self.finished = fragment, due, round_, finished


def _sparse(diloco):
    protocol = diloco.engine.protocol
    return None if protocol is None else protocol.sparse


def save(diloco) -> dict:
    sparse = _sparse(diloco)
    flight = diloco.in_flight
    pending = None if flight is None else {
        "fragment": flight.fragment, "due": flight.due, "round": flight.round,
        "delta": diloco.deltas[flight.fragment].detach().cpu().clone()}
    return {
        "format": FORMAT, "step": diloco.step_count,
        "schedule": None if diloco.schedule is None else diloco.schedule.as_dict(),
        "sync_period": None if diloco.period is None or diloco.period.decision is None else dict(diloco.period.decision),
        "rounds": list(diloco.rounds), "outer_steps": diloco.outer_steps,
        "globals": {name: g.detach().cpu().clone() for (name, _), g in zip(diloco.named, diloco.globals)},
        "outer_optimizer": copy.deepcopy(diloco.outer.state_dict()),
        "compression": compression_state_dict(diloco.pipeline, None, sum(diloco.rounds),
                                              None if sparse is None else sparse.state_dict()),
        "pending": pending,
        "bytes": {"sent": diloco.communicator.sent, "received": diloco.communicator.received},
        "shards": shard_ids(diloco.named),
    }


def load(diloco, state) -> None:
    if isinstance(state, dict) and "format" in state and checkpoint.scalar(state["format"]) == 2:
        state = dict(state, shards={})   # written before shards were recorded: a model without any
    state = checkpoint.checked_keys(OWNER, state, KEYS)
    if checkpoint.scalar(state["format"]) not in (2, FORMAT):
        raise ConfigError(f"{OWNER}: checkpoint format {quote(state['format'])}, this version reads 2 and {FORMAT}")
    mine = shard_ids(diloco.named)
    if state["shards"] != mine:
        raise ConfigError(f"{OWNER}: the checkpoint holds the shards {quote(state['shards'])} (parameter: its "
                          f"coordinate on its mesh, the mesh's shape) and this rank holds {mine}; each rank loads "
                          "the state it saved (torch.save per rank, or DiLoCo.distributed_checkpoint() in a "
                          "torch.distributed.checkpoint, which keys each rank's state by its rank)")
    decision, schedule = _checked_period(diloco, state["sync_period"])
    expected = None if schedule is None else schedule.as_dict()
    if state["schedule"] != expected:
        raise ConfigError(f"{OWNER}: the checkpoint's schedule {quote(state['schedule'])} differs from this "
                          f"DiLoCo's {expected}; build DiLoCo with the checkpoint's settings")
    step = checkpoint.STEP.check(OWNER, "step", checkpoint.scalar(state["step"]), "checkpoint field")
    outer_steps = checkpoint.COUNT.check(OWNER, "outer_steps", checkpoint.scalar(state["outer_steps"]),
                                         "checkpoint field")
    rounds = state["rounds"]
    if not isinstance(rounds, (list, tuple)) or len(rounds) != len(diloco.rounds):
        raise ConfigError(f"{OWNER}: 'rounds' must list {len(diloco.rounds)} counts, got {quote(rounds)}")
    rounds = [checkpoint.COUNT.check(OWNER, "rounds", checkpoint.scalar(r), "checkpoint field") for r in rounds]
    sent, received = (checkpoint.checked_fields(f"{OWNER} bytes", state["bytes"],
                                                {"sent": checkpoint.COUNT, "received": checkpoint.COUNT})[k]
                      for k in ("sent", "received"))
    globals_ = _checked_globals(diloco, state["globals"])
    pending = _checked_pending(diloco, schedule, state["pending"], step, rounds)
    before = copy.deepcopy(diloco.outer.state_dict())
    try:
        diloco.outer.load_state_dict(copy.deepcopy(state["outer_optimizer"]))
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise ConfigError(f"{OWNER}: the outer optimizer refused its state ({exc})") from None
    try:
        load_compression_state_dict(diloco.pipeline, None, state["compression"], "DiLoCo", _sparse(diloco))
    except Exception:
        diloco.outer.load_state_dict(before)
        raise
    with torch.no_grad():
        for g, value in zip(diloco.globals, globals_):
            g.copy_(value)
        diloco.deltas = [None] * len(diloco.groups)
        if pending is not None:
            diloco.delta_buffer(pending[0]).copy_(pending[3])
    diloco.in_flight = None if pending is None else InFlight(pending[0], pending[1], pending[2], finished=True)
    diloco.step_count, diloco.rounds, diloco.outer_steps = step, rounds, outer_steps
    if diloco.period is not None:
        diloco.period.decision = decision
        diloco.period.restart(step)   # without a decision the probe starts again from here
    diloco.schedule = schedule
    diloco.communicator.sent, diloco.communicator.received = sent, received


def shard_ids(named) -> dict:
    """Which shard of each sharded parameter this rank holds: name -> [its coordinate on the
    parameter's device mesh, the mesh's shape] (empty for a model without DTensor parameters)."""
    return {name: [list(p.device_mesh.get_coordinate() or []), list(p.device_mesh.shape)]
            for name, p in named if is_sharded(p)}


def _checked_globals(diloco, held) -> list:
    names = [name for name, _ in diloco.named]
    if not isinstance(held, dict) or sorted(map(str, held)) != sorted(names):
        got = sorted(map(str, held))[:8] if isinstance(held, dict) else type(held).__name__
        raise ConfigError(f"{OWNER}: 'globals' must hold the model's trainable parameters {names[:8]}, got {quote(got)}")
    out = []
    for name, p in diloco.named:
        value, shape = held[name], tuple(local(p).shape)   # a sharded parameter: this rank's shard
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape \
                or value.dtype != torch.float32:
            raise ConfigError(f"{OWNER}: global parameter {name!r} must be a float32 tensor of shape "
                              f"{shape}, got {quote(value)}")
        out.append(value)
    return out


def _checked_period(diloco, decision):
    """(the checkpoint's sync-period decision, the schedule it implies) for ``diloco``: a
    ``sync_every="auto"`` checkpoint loads only into an auto DiLoCo and brings its H."""
    if diloco.period is None:
        if decision is not None:
            raise ConfigError(f"{OWNER}: the checkpoint chose its sync period (sync_every='auto', H = "
                              f"{quote(decision.get('sync_every') if isinstance(decision, dict) else decision)}); "
                              "build DiLoCo with sync_every='auto' to resume it")
        return None, diloco.schedule
    if decision is None:
        return None, None
    decision = diloco.period.checked(decision)
    return decision, diloco.period.adopt_schedule(decision)


def _checked_pending(diloco, schedule, pending, step: int, rounds):
    """(fragment, due, round, mean Δ) of a checkpoint's pending reduction, or None."""
    if pending is None:
        return None
    if schedule is None:
        raise ConfigError(f"{OWNER}: a pending reduction before the sync period was chosen: {quote(pending)}")
    pending = checkpoint.checked_keys(f"{OWNER} pending", pending, ("fragment", "due", "round", "delta"))
    fragment, due, round_ = (checkpoint.scalar(pending[k]) for k in ("fragment", "due", "round"))
    if not isinstance(fragment, int) or not 0 <= fragment < len(diloco.groups):
        raise ConfigError(f"{OWNER}: pending fragment {quote(fragment)} is not one of 0..{len(diloco.groups) - 1}")
    if not isinstance(due, int) or not step < due <= step + schedule.delay:
        raise ConfigError(f"{OWNER}: pending reduction due at inner step {quote(due)}, which is not within "
                          f"delay={schedule.delay} after step {step}")
    if not isinstance(round_, int) or not 0 <= round_ < rounds[fragment]:
        raise ConfigError(f"{OWNER}: pending round {quote(round_)} of fragment {fragment} was never submitted")
    delta = pending["delta"]
    numel = local_numel(diloco.named, diloco.groups[fragment])
    if not isinstance(delta, torch.Tensor) or delta.dtype != torch.float32 or tuple(delta.shape) != (numel,):
        raise ConfigError(f"{OWNER}: pending delta must be a float32 tensor of {numel} elements, got {quote(delta)}")
    return fragment, due, round_, delta


def stats(loop) -> dict:
    """:meth:`deepreduce.torch.diloco.DiLoCo.stats`: the engine's figures and the outer loop's:
    ``outer_steps`` (fragment reductions applied), ``inner_steps``, ``sent_bytes`` /
    ``received_bytes`` (this rank, all outer steps), their means per outer step, and bits per
    parameter per inner step sent and received (``8 * bytes / (parameters * inner steps)``);
    ``sync_every`` (None while ``"auto"`` has not chosen yet) and, under ``"auto"``,
    ``sync_period``: the decision (H, option, predicted inner step seconds and bits per parameter
    per inner step, and the measured inputs: compute seconds per rank, link, codec costs)."""
    out = loop.engine.stats()
    sent, received, steps = loop.communicator.sent, loop.communicator.received, loop.outer_steps
    numel = local_numel(loop.named)
    per = 8.0 / (numel * max(loop.step_count, 1))
    out.update(outer_steps=steps, inner_steps=loop.step_count, parameters=numel, fragments=len(loop.groups),
               sent_bytes=sent, received_bytes=received,
               sent_bytes_per_outer_step=sent / steps if steps else 0.0,
               received_bytes_per_outer_step=received / steps if steps else 0.0,
               bits_per_parameter_per_inner_step=sent * per,
               received_bits_per_parameter_per_inner_step=received * per,
               sync_every=None if loop.schedule is None else loop.schedule.sync_every)
    if loop.period is not None:
        out["sync_period"] = None if loop.period.decision is None else dict(loop.period.decision)
    return out


def agreed_layout(diloco) -> agreement.Layout:
    """What the workers of ``diloco`` must agree on before an outer step: the parameters' local
    shapes and dtypes, the config, schedule, outer optimizer, inner step and item layout."""
    label, digest = agreement.compressor_identity(diloco.pipeline)
    outer = f"outer {type(diloco.outer).__name__} {hyperparameters(diloco.outer)}"
    schedule = diloco.period.describe() if diloco.schedule is None else diloco.schedule.describe()
    extra = f"; {schedule}; {outer}; inner step {diloco.step_count}; {diloco.layout} items"
    digest = hashlib.blake2b((digest + extra).encode(), digest_size=8).hexdigest()
    tensors = [(n, tuple(local(p).shape), str(p.dtype).replace("torch.", "")) for n, p in diloco.named]
    return agreement.Layout((label + extra, digest), tensors, "parameter")
