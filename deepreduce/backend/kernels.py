"""The passes over whole tensors: compensation with finiteness scan, the selections (non-zero,
Top-r, threshold), and scatter-add decode.

Each function runs the C++ kernel of ``csrc/select`` (module ``deepreduce._select``: GIL
released, large tensors split over ``threads`` std::threads) for NumPy input when it is built;
otherwise the rule written here once on the array namespace (NumPy without the extension, or
torch tensors on their own device). All paths give identical positions, and the thread count
never changes one: threads work on fixed blocks whose outcomes are combined in block order.

Top-r's tie rule: ``argpartition`` (and ``torch.topk``) pick arbitrary members of a group of
equal magnitudes at the cut, so two bindings could select different positions for the same
gradient. Here the cut value is the r-th largest magnitude; every larger entry is taken, and the
remaining places go to the entries equal to the cut value in ascending position order. The C++
kernel is a radix select on the magnitudes' float32 bit patterns (sign bit cleared; for non-NaN
floats their order is the order of the magnitudes) with the same rule. Inputs are finite (the
pipeline sends non-finite gradients dense).

``scan(..., topk=r)`` also selects the Top-r of the compensated gradient in the same pass over
memory (see ``csrc/select/select.h``): a sample of evenly spaced blocks gives a magnitude bound
about 1.3 r entries reach, the pass gathers them while it compensates, and the cut is resolved
among those. So a pipeline with error feedback reads the gradient and the residual once for
compensation, finiteness and selection.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from ..errors import ContainerError
from . import _native, arrays, deferred_checks

BLOCK = 4096  # compensation blocks: a non-finite block is never added into the residual


def native():
    """The C++ module, or None (NumPy path)."""
    return _native.load("select")


def scan(flat: np.ndarray, residual: Optional[np.ndarray] = None, topk: int = 0,
         threads: int = 1, prior: Optional[np.ndarray] = None) -> Tuple[bool, Optional[np.ndarray]]:
    """One pass over a float32 gradient: is it finite; with ``residual``, compensate.

    With ``residual`` (float32, same size) the compensated gradient ``prior + flat`` is written
    into it block by block: ``prior=None`` adds in place (``residual += flat``), otherwise
    ``prior`` (the residual before the step, kept intact for a step that may be undone) is read
    and ``residual`` is a second buffer, so keeping the old residual costs no copy. Afterwards the
    residual *is* the compensated gradient. When ``flat`` holds a NaN or Inf, the step is refused
    and the residual holds ``prior`` again: out of place exactly (a copy); in place, blocks holding
    one are never added, the others are taken out again (``residual = (residual + flat) - flat``,
    which restores each entry to within two float32 roundings of ``|residual + flat|``).

    Returns ``(finite, positions)``: with ``0 < topk < size`` and a finite gradient, positions
    are the Top-``topk`` of the compensated gradient (:func:`topk_positions`),
    otherwise None.
    """
    select = 0 < topk < flat.shape[0]
    module = None if arrays.is_torch(flat) else native()
    if module is not None:
        return module.scan(flat, residual, topk if select else 0, threads, prior)
    # The array path: NumPy without the extension, or torch tensors on their device (the torch
    # pipeline selects on the device itself, so it never asks for ``topk`` here).
    xp = arrays.namespace(flat)
    finite = bool(xp.all(xp.isfinite(flat)))
    if not finite:
        if prior is not None:
            residual[...] = prior
        elif residual is not None:
            _add_and_take_out_finite_blocks(flat, residual)
        return False, None
    if prior is not None:
        xp.add(prior, flat, out=residual)
    elif residual is not None:
        residual += flat
    if not select:
        return True, None
    return True, topk_positions(flat if residual is None else residual, topk)


def _add_and_take_out_finite_blocks(flat: np.ndarray, residual: np.ndarray) -> None:
    """What the C++ scan leaves in the residual after a refused step (see ``scan``)."""
    xp = arrays.namespace(flat)
    for start in range(0, flat.shape[0], BLOCK):
        block = flat[start:start + BLOCK]
        if bool(xp.all(xp.isfinite(block))):
            part = residual[start:start + BLOCK]
            part += block
            part -= block


def check_indices(indices: np.ndarray, numel: int, ascending: bool, checks=None) -> None:
    """ContainerError unless ``indices`` are distinct positions in ``[0, numel)``, in O(n).

    ``ascending``: the codec promises strictly ascending indices, so one comparison of
    neighbours checks both the promise and uniqueness; otherwise uniqueness is checked on a
    sorted copy of the ``n`` indices. ``checks`` (a :class:`~deepreduce.backend.deferred_checks.
    DeferredChecks`, torch only): the checks are recorded there instead of read now.
    """
    xp, n = arrays.namespace(indices), indices.shape[0]
    if n == 0:
        return
    ordered = indices if ascending else xp.sort(indices)
    if checks is not None:
        if n > 1:
            distinct = ordered[1:] > ordered[:-1] if ascending else ordered[1:] != ordered[:-1]
            checks.expect(distinct.all(), lambda: ContainerError(_REPEATED[ascending]))
        checks.expect((ordered[0] >= 0) & (ordered[-1] < numel), lambda: _out_of_range(numel))
        return
    if n > 1:
        distinct = ordered[1:] > ordered[:-1] if ascending else ordered[1:] != ordered[:-1]
        if not bool(xp.all(distinct)):
            raise ContainerError(_REPEATED[ascending])
    if int(ordered[0]) < 0 or int(ordered[-1]) >= numel:
        raise _out_of_range(numel)


_REPEATED = {True: "container indices are not strictly ascending although the index codec promises "
                   "ascending order (an index is repeated or out of order)",
             False: "container repeats an index"}


def _out_of_range(numel: int) -> ContainerError:
    return ContainerError(f"container index out of range for a tensor of {numel} elements")


def _host_kernel(values, dtype=np.float32):
    """The C++ module when ``values`` is a NumPy array of ``dtype`` and the module is built."""
    if type(values) is not np.ndarray or values.dtype != dtype:
        return None
    return native()


def nonzero(flat, threads: int = 1):
    """Ascending int64 positions of the non-zero entries of a flat array (as
    ``numpy.flatnonzero``: -0.0 is zero, NaN is not), branch-free in C++ for float32 NumPy
    input: at half density, where a branch per entry is mispredicted every other time, about 9x
    faster than NumPy."""
    module = _host_kernel(flat)
    if module is not None:
        return module.nonzero(flat, threads)
    return arrays.adapter(flat).positions(flat != 0)


def topk_positions(values, r: int, threads: int = 1):
    """Ascending int64 positions of the ``r`` entries of largest magnitude (ties: lowest first).

    ``values`` (NumPy or a tensor, 1-D) may be signed (magnitudes are taken) or magnitudes.
    """
    d = values.shape[0]
    if r >= d or r <= 0:
        return _range_like(values, max(0, min(r, d)))
    if type(values) is np.ndarray:
        module = native()
        if module is not None:
            return module.topk(np.ascontiguousarray(values, dtype=np.float32), int(r), threads)
    a, xp = arrays.adapter(values), arrays.namespace(values)
    magnitudes = xp.abs(values)
    cut = a.kth_largest(magnitudes, r)
    above = a.positions(magnitudes > cut)
    at = a.positions(magnitudes == cut)[: r - above.shape[0]]
    return xp.sort(xp.concat([above, at]))


def threshold_positions(values, threshold: float, threads: int = 1):
    """Ascending int64 positions with ``|value| >= threshold`` (compared in float32)."""
    cut = float(np.float32(threshold))
    if type(values) is np.ndarray:
        module = native()
        if module is not None:
            return module.threshold(np.ascontiguousarray(values, dtype=np.float32), cut, threads)
    xp = arrays.namespace(values)
    return arrays.adapter(values).positions(xp.abs(values) >= cut)


def _range_like(values, n: int):
    """Positions ``0 .. n-1`` as int64 in ``values``' framework and device."""
    xp = arrays.namespace(values)
    if type(values) is np.ndarray:
        return np.arange(n, dtype=np.int64)
    return xp.arange(n, dtype=xp.int64, device=values.device)


def scatter_add(out: np.ndarray, indices: np.ndarray, values: np.ndarray, ascending: bool,
                threads: int = 1, checks=None):
    """``out[indices] += values`` after :func:`check_indices` (``out`` flat float32, written in place;
    a torch ``out`` is accumulated on its device; with ``checks`` the index checks are deferred
    there and the positions clamped into range meanwhile). Returns the positions written."""
    if arrays.is_torch(out):
        check_indices(indices, out.shape[0], ascending, checks)
        safe = indices if checks is None else deferred_checks.in_range(indices, out.shape[0])
        arrays.adapter(out).scatter_add(out, safe, values)
        return safe
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    values = np.ascontiguousarray(values, dtype=np.float32)
    module = native()
    if module is None:
        check_indices(indices, out.size, ascending)
        out[indices] += values
        return indices
    try:   # the checked O(n) kernel: strictly ascending in-range indices, else it writes nothing
        module.scatter_add(out, indices, values, threads)
        return indices
    except ValueError as exc:
        if ascending:
            raise ContainerError(str(exc)) from exc
    # no ascending order was promised (an order-keeping index codec): checked on a sorted copy
    check_indices(indices, out.size, ascending)
    module.scatter_add_unchecked(out, indices, values, threads)
    return indices


def subtract_at(target: np.ndarray, positions: np.ndarray, values: np.ndarray, threads: int = 1) -> None:
    """``target[positions] -= values`` for distinct in-range positions (``a - b == a + (-b)`` exactly)."""
    module = None if arrays.is_torch(target) else native()
    if module is None:
        arrays.adapter(target).scatter_add(target, positions, -values)
    else:
        module.scatter_add_unchecked(target, np.ascontiguousarray(positions, dtype=np.int64),
                                     np.negative(values, dtype=np.float32), threads)
