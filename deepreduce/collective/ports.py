"""What a binding implements for the step engine (:mod:`deepreduce.collective.step`).

A binding says how bytes move (:class:`Transport`) and how to read and write its tensors
(:class:`Tensors`); the engine and its routes (:mod:`deepreduce.collective.routes`) do the rest.
Both are plain protocols: a binding passes any object with these methods, it inherits nothing.
"""
from __future__ import annotations

from typing import Any, Callable, List, Protocol, Sequence, Tuple

import numpy as np


class Pending:
    """A collective in flight: ``wait()`` returns its result once (later calls return the same).

    ``wait`` is a callable that blocks until the collective completed; a transport whose
    collective is blocking passes a callable that starts and completes it."""

    __slots__ = ("_wait", "_done", "_result")

    def __init__(self, wait: Callable[[], Any]) -> None:
        self._wait, self._done, self._result = wait, False, None

    def wait(self):
        if not self._done:
            self._result, self._done = self._wait(), True
        return self._result


class Transport(Protocol):
    """How one binding moves bytes among the ranks of its group.

    ``allgather(payload, name)``: every rank's uint8 payload, in rank order (each a segment of
    what the collective received; a torch payload may stay on its device). ``alltoall(payloads,
    name)``: ``payloads[j]`` to rank ``j``; what every rank sent to this one. ``allreduce(tensor,
    name)``: the element-wise sum over the ranks of a binding tensor (in place where the binding
    can). Each returns a :class:`Pending`; names match collectives across ranks.
    """

    rank: int
    size: int

    def allgather(self, payload, name: str) -> Pending: ...

    def alltoall(self, payloads: List[np.ndarray], name: str) -> Pending: ...

    def allreduce(self, tensor, name: str) -> Pending: ...


class Tensors(Protocol):
    """How the engine reads and writes one binding's tensors (torch: :mod:`deepreduce.torch.tensors`)."""

    def host(self, tensor) -> np.ndarray:
        """A flat float32 NumPy view (or copy) of ``tensor`` on the host."""

    def write(self, target, flat: np.ndarray) -> None:
        """Copy the flat float32 ``flat`` into ``target`` (its shape, dtype and device); nothing
        to do where ``flat`` is :meth:`host`'s view of ``target`` (a route decoded into it)."""

    def divide(self, target, ranks: int) -> None:
        """``target /= ranks`` in place."""

    def add(self, target, flat: np.ndarray) -> None:
        """``target += flat`` in place (the residual flush of a tensor sent dense)."""

    def entries(self, tensor) -> Tuple[np.ndarray, np.ndarray]:
        """A sparse gradient's (ascending flat positions, float32 values)."""

    def from_entries(self, positions: np.ndarray, values: np.ndarray, like) -> Any:
        """A sparse gradient like ``like`` holding ``values`` at ``positions``."""

    def copy(self, target, source) -> None:
        """Copy the binding tensor ``source`` into ``target``."""

    def with_flag(self, tensor, dtype: str, flag: float) -> Any:
        """A new flat tensor: ``tensor`` (or a list of tensors, end to end) in ``dtype`` (``"same"``:
        its own; zeros where ``flag``), then one element holding ``flag``
        (:mod:`deepreduce.collective.routes.dense`)."""

    def split_flag(self, summed) -> Tuple[Any, float]:
        """(the data, the flag's value) of an all-reduced :meth:`with_flag` tensor."""

    def like(self, flat, shaped) -> Any:
        """``flat`` in ``shaped``'s shape."""

    def all_finite(self, tensor) -> bool: ...

    def float32(self, tensor) -> bool:
        """Whether ``tensor`` holds float32: a sum divided in place there rounds once; any other
        dtype (bf16, fp16) takes the float32 quotient instead, so it is rounded once too."""

    def is_sparse(self, tensor) -> bool: ...

    def numel(self, tensor) -> int: ...

    def shape(self, tensor) -> Sequence[int]: ...


def start_allgather(communicator, payload, name: str):
    """``communicator``'s asynchronous allgather, or its blocking one issued at ``wait()``."""
    start = getattr(communicator, "allgather_async", None)
    return start(payload, name) if start is not None else Pending(lambda: communicator.allgather(payload, name))


def start_alltoall(communicator, payloads: List[np.ndarray], name: str):
    """``communicator``'s asynchronous alltoall, or its blocking one issued at ``wait()``."""
    start = getattr(communicator, "alltoall_async", None)
    return start(payloads, name) if start is not None else Pending(lambda: communicator.alltoall(payloads, name))


class NumpyTensors:
    """The tensor port for flat float32 NumPy arrays (a binding that reduces host copies: the
    TensorFlow reducer's host op). Stateless."""

    @staticmethod
    def host(tensor) -> np.ndarray:
        return np.asarray(tensor, dtype=np.float32).reshape(-1)

    @staticmethod
    def write(target, flat) -> None:
        flat = np.asarray(flat).reshape(-1)
        if flat.dtype == target.dtype and flat.size == target.size and flat.ctypes.data == target.ctypes.data \
                and target.flags.c_contiguous:   # host()'s view of the target itself: nothing to copy
            return
        np.copyto(target.reshape(-1), flat, casting="same_kind")

    copy = write

    @staticmethod
    def divide(target, ranks: int) -> None:
        np.divide(target, target.dtype.type(ranks), out=target)

    @staticmethod
    def add(target, flat) -> None:
        target.reshape(-1)[...] += np.asarray(flat, dtype=target.dtype).reshape(-1)

    @staticmethod
    def with_flag(tensor, dtype: str, flag: float) -> np.ndarray:
        parts = [np.asarray(t) for t in (tensor if isinstance(tensor, (list, tuple)) else [tensor])]
        kind = parts[0].dtype if dtype == "same" else np.dtype(dtype)
        out = np.zeros(sum(p.size for p in parts) + 1, dtype=kind)
        if not flag:
            out[:-1] = np.concatenate([p.reshape(-1) for p in parts])
        out[-1] = flag
        return out

    @staticmethod
    def split_flag(summed):
        return summed[:-1], float(summed[-1])

    @staticmethod
    def like(flat, shaped):
        return flat.reshape(np.shape(shaped))

    @staticmethod
    def all_finite(tensor) -> bool:
        return bool(np.isfinite(tensor).all())

    @staticmethod
    def float32(tensor) -> bool:
        return np.asarray(tensor).dtype == np.float32

    @staticmethod
    def is_sparse(tensor) -> bool:
        return False

    @staticmethod
    def numel(tensor) -> int:
        return int(np.size(tensor))

    @staticmethod
    def shape(tensor) -> Sequence[int]:
        return tuple(np.shape(tensor))
