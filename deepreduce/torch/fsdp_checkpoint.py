"""The FSDP comms' per-rank state in a ``torch.distributed.checkpoint`` (DCP) checkpoint.

:class:`~deepreduce.torch.fsdp.FSDPCompression` is a DCP ``Stateful``: put the handle that
``register`` returns beside the sharded model and optimizer,
``dcp.save({"model": ..., "optim": ..., "compression": handle}, checkpoint_id=...)``, and load
the same way into a freshly registered handle; the next steps send byte-identical containers.

Why this layout. The state is per rank (a residual of this rank's reduce-scatter input, the
owner residuals of this rank's shard, step counters) and does not reshard. DCP merges keys
across ranks and keeps one copy of a value saved under the same key by several ranks, so each
rank writes its own key, ``rank<r>``; and ``dcp.load`` fills in place what a fresh state's
``state_dict()`` returns, which for a fresh handle has no residuals yet (they are created on the
first backward, with the shapes FSDP hands the comm). So a rank's state travels as one value
that DCP saves and loads whole: ``bytes`` of ``torch.save`` of plain tensors, ints and strings,
read back with ``torch.load(weights_only=True)``. ``meta`` (the same on every rank: one copy is
kept) holds the world size and the config digest, so that a load into another config or world
size is refused on every rank alike with a ConfigError. With more ranks than the checkpoint was
saved by, DCP's own strict load fails first, naming the missing key ``<prefix>.rank<r>``.

A state is checked whole before any of it is applied (the pipeline's and the sparse
all-reduce's own checks, :mod:`deepreduce.checkpoint`); an engine that does not exist yet (a
fresh process) receives its state when the first backward creates it.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch.distributed as dist

from .. import checkpoint
from ..errors import ConfigError, quote
from .arguments import build_pipeline
from .checkpoint import compression_state_dict, load_compression_state_dict, to_numpy
from .rank_state import mine, packed, rank_key, unpacked

FORMAT = 1
OWNER = "deepreduce.torch.fsdp checkpoint"
ENGINE_KEYS = ("format", "step", "compression", "aggregation", "group_size")
BLOB_KEYS = ("format", "world", "rank", "config", "engines", "steps")


def engine_key(role: str, average: bool) -> str:
    """The key of one step engine's state: its role and whether it averages (stable across
    processes, unlike the process group object the engine runs over)."""
    return f"{role}/{'average' if average else 'sum'}"


def save(engines: Dict[str, object], pending: Dict[str, dict], steps: Dict[Tuple[str, str], int],
         digest: str) -> dict:
    """``{"meta": {...}, "rank<r>": bytes}``: this rank's state (``engines``: engine key ->
    StepEngine; ``pending``: engine key -> a state loaded for an engine not built yet, saved as
    it was loaded; ``steps``: (role, module) -> steps taken)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    saved = dict(pending)
    for key, engine in engines.items():
        sparse = engine.protocol.sparse
        state = compression_state_dict(engine.codec, None, engine.steps,
                                       None if sparse is None else sparse.state_dict())
        state.setdefault("aggregation", None)
        saved[key] = dict(state, group_size=engine.communicator.size)
    blob = {"format": FORMAT, "world": world, "rank": rank, "config": digest, "engines": saved,
            "steps": {f"{role}|{module}": n for (role, module), n in steps.items()}}
    return {"meta": {"format": FORMAT, "world": world, "config": digest}, rank_key(rank): packed(blob)}


def load(state, digest: str, compression, path: str) -> Tuple[Dict[str, dict], Dict[Tuple[str, str], int]]:
    """This rank's part of ``state`` (what :func:`save` returned, as DCP loaded it), checked:
    (engine key -> engine state, (role, module) -> steps). A ConfigError names what does not
    match (another config, world size or rank, a malformed field); nothing is applied here."""
    world, rank = dist.get_world_size(), dist.get_rank()
    value = mine(OWNER, state, rank)
    meta = checkpoint.checked_keys(f"{OWNER} meta", state["meta"], ("format", "world", "config"))
    _check_header(meta, world, digest)
    blob = checkpoint.checked_keys(f"{OWNER} of rank {rank}", unpacked(OWNER, value, rank), BLOB_KEYS)
    _check_header(blob, world, digest)
    if checkpoint.scalar(blob["rank"]) != rank:
        raise ConfigError(f"{OWNER}: the state under {rank_key(rank)!r} was saved by rank {quote(blob['rank'])}")
    engines = blob["engines"]
    if not isinstance(engines, dict):
        raise ConfigError(f"{OWNER}: 'engines' must map engine keys to states, got {type(engines).__name__}")
    checked = {str(key): _checked_engine(key, value, compression, path) for key, value in engines.items()}
    steps = blob["steps"]
    if not isinstance(steps, dict) or not all(isinstance(k, str) and "|" in k for k in steps):
        raise ConfigError(f"{OWNER}: 'steps' must map 'role|module' to step counts")
    counts = {tuple(k.split("|", 1)): checkpoint.STEP.check(OWNER, f"steps of {k!r}", checkpoint.scalar(n),
                                                             "checkpoint field")
              for k, n in steps.items()}
    return checked, counts


def apply(engine, state: dict) -> None:
    """Restore one engine's checked ``state`` (from :func:`load`); its group must have as many
    ranks as the one that saved it."""
    size = state["group_size"]
    if engine.communicator.size != size:
        raise ConfigError(f"{OWNER}: the state was saved over a group of {size} ranks, this engine's group has "
                          f"{engine.communicator.size}")
    sparse = engine.protocol.sparse
    engine.steps = load_compression_state_dict(engine.codec, None, _as_saved(state), OWNER, sparse)


def _check_header(header: dict, world: int, digest: str) -> None:
    if checkpoint.scalar(header["format"]) != FORMAT:
        raise ConfigError(f"{OWNER}: format {quote(header['format'])}, this version reads {FORMAT}")
    saved_world = checkpoint.scalar(header["world"])
    if saved_world != world:
        raise ConfigError(f"{OWNER}: saved by {quote(saved_world)} ranks, this run has {world}; the compressor "
                          "state is per rank and does not reshard (register afresh to start it from zero)")
    if header["config"] != digest:
        raise ConfigError(f"{OWNER}: saved with another compression config (digest {quote(header['config'])}, "
                          f"this handle's {digest})")


def _checked_engine(key, state, compression, path: str) -> dict:
    """One engine's state, checked on a scratch pipeline of the same config (and the sparse
    all-reduce's checks for its group size)."""
    owner = f"{OWNER} engine {quote(key)}"
    state = checkpoint.checked_keys(owner, state, ENGINE_KEYS)
    size = checkpoint.COUNT.check(owner, "group_size", checkpoint.scalar(state["group_size"]), "checkpoint field")
    if size < 1:
        raise ConfigError(f"{owner}: group_size must be at least 1, got {size}")
    checkpoint.checked_step(_as_saved(state), owner, state["aggregation"] is not None)
    build_pipeline(compression, path).core.load_state_dict(to_numpy(state["compression"]))
    if state["aggregation"] is not None:
        checkpoint.checked_aggregation(owner, to_numpy(state["aggregation"]), size)
    return dict(state, group_size=size)


def _as_saved(state: dict) -> dict:
    """The part :func:`~deepreduce.torch.checkpoint.load_compression_state_dict` reads."""
    out = {k: state[k] for k in checkpoint.STATE_KEYS}
    if state["aggregation"] is not None:
        out["aggregation"] = state["aggregation"]
    return out


def by_state_key(engines: dict) -> dict:
    """``{state key: engine}`` of a handle's ``{(group, role, average): engine}``: a checkpoint
    keeps one state per role and averaging (:func:`engine_key`)."""
    out = {}
    for (_, role, average), engine in engines.items():
        key = engine_key(role, average)
        if key in out:
            raise ConfigError(f"deepreduce.torch.fsdp: two process groups serve {key!r}; a checkpoint "
                              "keeps one state per role and averaging")
        out[key] = engine
    return out


def nbytes(state) -> int:
    """Bytes of the arrays in a (nested) state dict."""
    if isinstance(state, dict):
        return sum(nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(nbytes(v) for v in state)
    return int(getattr(state, "nbytes", 0))
