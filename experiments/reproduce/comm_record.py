"""What a rank's collectives carry: every ``torch.distributed`` call a training step makes, recorded.

``deepreduce reproduce semisync`` replays training over a shaped link instead of training on it
(:mod:`experiments.reproduce.semisync`), so it needs the exact messages of each step: the kind
of collective and the bytes each rank put into it. :class:`CollectiveRecorder` wraps the
module-level functions of ``torch.distributed`` that PyTorch's DDP hooks, FSDP2 and deepreduce's
communicators call (``all_reduce``, ``all_gather``, ``all_gather_into_tensor``,
``all_gather_single``, ``all_to_all_single``, ``broadcast``, ``reduce_scatter_tensor``,
``reduce_scatter_single``) while it is active, records ``(op, bytes_in, bytes_received)`` per
call and the global ranks of its process group (``ranks``; None for the default group, which
:mod:`~experiments.reproduce.hsdp` uses to tell the traffic between "nodes" from the traffic
inside one) and passes the call through unchanged. Whatever
issues the collective (a DDP hook, the deepreduce step engine, an outer loop) is measured the same
way, with no knowledge of its internals.

Per call, ``bytes_in`` is what this rank hands to the collective (its message) and
``bytes_received`` what the collective delivers to it from the other ranks: for ``all_reduce``
the reduced tensor (its own size), for the gathers the other ranks' parts, for
``all_to_all_single`` the parts addressed to it by the others, for ``broadcast`` the tensor on
every rank but the root. These are collective-level figures; a ring all-reduce puts
``2 (N - 1) / N`` times the tensor on the wire each way, which the time phase measures directly.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional

OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all_single", "broadcast",
       "reduce_scatter_tensor", "reduce_scatter_single")


def _nbytes(tensor) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def _split_bytes(tensor, splits: Optional[List[int]], world: int) -> List[int]:
    """Bytes of each part of ``tensor`` split along dim 0 by ``splits`` (equal parts when None)."""
    row = _nbytes(tensor) // max(1, int(tensor.shape[0])) if tensor.dim() else _nbytes(tensor)
    if not splits:
        return [_nbytes(tensor) // world] * world
    return [int(s) * row for s in splits]


def message(op: str, args: tuple, kwargs: dict, rank: int, world: int) -> Dict[str, object]:
    """``{"op", "bytes_in", "bytes_received"}`` of one call of ``torch.distributed.<op>``."""
    if op == "all_reduce":
        n = _nbytes(args[0] if args else kwargs["tensor"])
        return {"op": op, "bytes_in": n, "bytes_received": n}
    if op == "all_gather":
        outputs, tensor = (list(args[:2]) + [None, None])[:2]
        outputs = outputs if outputs is not None else kwargs["tensor_list"]
        tensor = tensor if tensor is not None else kwargs["tensor"]
        n = _nbytes(tensor)
        return {"op": op, "bytes_in": n, "bytes_received": sum(_nbytes(t) for t in outputs) - n}
    if op in ("all_gather_into_tensor", "all_gather_single"):
        output, tensor = (list(args[:2]) + [None, None])[:2]
        output = output if output is not None else kwargs["output_tensor"]
        tensor = tensor if tensor is not None else kwargs["input_tensor"]
        n = _nbytes(tensor)
        return {"op": op, "bytes_in": n, "bytes_received": _nbytes(output) - n}
    if op == "all_to_all_single":
        output, tensor = (list(args[:2]) + [None, None])[:2]
        output = output if output is not None else kwargs["output"]
        tensor = tensor if tensor is not None else kwargs["input"]
        out_splits = kwargs.get("output_split_sizes", args[2] if len(args) > 2 else None)
        in_splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
        sent = _split_bytes(tensor, in_splits, world)
        got = _split_bytes(output, out_splits, world)
        return {"op": op, "bytes_in": sum(sent) - sent[rank], "bytes_received": sum(got) - got[rank]}
    if op == "broadcast":
        tensor = args[0] if args else kwargs["tensor"]
        src = args[1] if len(args) > 1 else kwargs.get("src", 0)
        n = _nbytes(tensor)
        return {"op": op, "bytes_in": n if rank == src else 0, "bytes_received": 0 if rank == src else n}
    if op in ("reduce_scatter_tensor", "reduce_scatter_single"):
        output, tensor = (list(args[:2]) + [None, None])[:2]
        output = output if output is not None else kwargs["output"]
        tensor = tensor if tensor is not None else kwargs["input"]
        return {"op": op, "bytes_in": _nbytes(tensor), "bytes_received": _nbytes(output)}
    raise ValueError(f"comm_record: unknown collective {op!r}; known: {', '.join(OPS)}")


class CollectiveRecorder:
    """Wraps ``torch.distributed``'s collectives; records the calls made while ``recording``.

    ``install()`` patches the module functions (``uninstall()`` restores them); calls the
    installing thread makes while ``recording`` is False (evaluation, barriers of the harness) pass
    through unrecorded. Calls from any other thread are always recorded: they are a reduction
    running in the background (DiLoCo's engine thread with a ``delay``), which may finish between
    two steps or during an evaluation, and belong to the training's messages (they go to the next
    ``take()``). ``take()`` returns the calls recorded since the last ``take()`` and forgets them.
    """

    def __init__(self) -> None:
        self.recording = False
        self.calls: List[Dict[str, object]] = []
        self._saved: Dict[str, Callable] = {}
        self._owner: Optional[int] = None
        self._lock = threading.Lock()

    def install(self) -> "CollectiveRecorder":
        import torch.distributed as dist

        self._owner = threading.get_ident()
        for op in OPS:
            original = getattr(dist, op, None)
            if original is None or op in self._saved:
                continue
            self._saved[op] = original
            setattr(dist, op, self._wrap(op, original, dist))
        return self

    def uninstall(self) -> None:
        import torch.distributed as dist

        for op, original in self._saved.items():
            setattr(dist, op, original)
        self._saved = {}

    def _wrap(self, op: str, original: Callable, dist) -> Callable:
        def call(*args, **kwargs):
            if self.recording or threading.get_ident() != self._owner:
                group = kwargs.get("group")
                call = message(op, args, kwargs, dist.get_rank(group), dist.get_world_size(group))
                call["ranks"] = None if group is None else list(dist.get_process_group_ranks(group))
                with self._lock:
                    self.calls.append(call)
            return original(*args, **kwargs)

        call.__wrapped__ = original
        return call

    def take(self) -> List[Dict[str, object]]:
        with self._lock:
            calls, self.calls = self.calls, []
        return calls


def totals(calls: List[Dict[str, object]]) -> Dict[str, int]:
    """``{"sent": bytes handed to the collectives, "received": bytes delivered from others}``."""
    return {"sent": int(sum(c["bytes_in"] for c in calls)), "received": int(sum(c["bytes_received"] for c in calls))}
