"""Torch-native sparsifiers: the same selection as the NumPy core, on the tensor's own device.

:func:`select_torch` is what the torch pipeline calls: given a built sparsifier component, a
flat float32 tensor (CPU or GPU) and the encode context, it returns the ascending int64
positions the NumPy ``sparsifier.select`` returns for the same data, name and step. On the CPU
that *is* the core's selection (its C++ kernels on a zero-copy NumPy view, faster than any
torch formulation); on other devices :func:`select_torch_native` runs torch operations on the
device (tests run it on CPU tensors against the core).

How "the same selection" is kept:

* Top-r (and the hierarchical Top-r of DGC, the Top-1 fallback of SIDCo) uses the core's tie
  rule (``deepreduce.sparsify._topk``): the r-th largest magnitude is the smallest value
  ``torch.topk`` returns; ties at the cut go to the lowest positions.
* Random positions (Random-r, DGC's sample) are drawn by NumPy from ``ctx.rng(...)`` -- the
  same generator and seed as the core -- and copied to the device. NumPy and torch generators
  produce different streams, so drawing on the device could not match the core; the draw is
  small (r positions, or a 1% sample) next to the selection itself.
* SIDCo runs the core's algorithm (``sidco.sidco_select``) over torch operations; statistics
  are accumulated in float64 on the device, the scalar fit is the core's Python code, and the
  threshold is rounded to float32 once, as in the core. Selections agree unless an entry lies
  within float64 rounding of the threshold.
* Thresholds are compared in float32 (the threshold rounded once), like NumPy.
"""
from __future__ import annotations

from typing import Callable, Dict

import numpy as np
import torch

from ..backend.arrays import host_fallback
from ..errors import DeepReduceError
from ..wire.seeding import EncodeContext
from ..sparsify import _fits
from ..sparsify._base import Sparsifier, count_for
from ..sparsify.dgc import sample_count, sample_positions
from ..sparsify.sidco import sidco_select

__all__ = ["select_torch", "select_torch_native", "topk_positions", "TorchOps"]


def _f32(value: float) -> float:
    return float(np.float32(value))


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(mask, as_tuple=False).flatten()


def topk_positions(magnitudes: torch.Tensor, r: int) -> torch.Tensor:
    """Ascending positions of the ``r`` largest magnitudes, ties to the lowest position."""
    d = magnitudes.numel()
    device = magnitudes.device
    if r <= 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    if r >= d:
        return torch.arange(d, dtype=torch.int64, device=device)
    cut = torch.topk(magnitudes, r, sorted=False).values.min()  # the r-th largest magnitude
    above = _positions(magnitudes > cut)
    at = _positions(magnitudes == cut)[: r - above.numel()]
    chosen, _ = torch.sort(torch.cat([above, at]))
    return chosen


class TorchOps:
    """The array operations of ``sidco.sidco_select`` on torch tensors (float64 accumulation)."""

    @staticmethod
    def magnitudes(flat):
        return flat.abs()

    @staticmethod
    def first_stats(a, need_var: bool, need_log: bool) -> _fits.Stats:
        n = int(torch.count_nonzero(a))
        if n == 0:
            return _fits.Stats(0, 0.0)
        mean = float(a.sum(dtype=torch.float64)) / n
        var = mean_log = float("nan")
        if need_var:
            dev = a.double() - mean
            var = (float(torch.dot(dev, dev)) - (a.numel() - n) * mean * mean) / n
        if need_log:
            mean_log = float(a[a > 0].double().log().sum()) / n
        return _fits.Stats(n, mean, var, mean_log)

    @staticmethod
    def tail_stats(x, shift: float, need_var: bool) -> _fits.Stats:
        n = int(x.numel())
        if n == 0:
            return _fits.Stats(0, 0.0)
        mean = float(x.sum(dtype=torch.float64)) / n
        var = float("nan")
        if need_var:
            dev = x.double() - mean
            var = float(torch.dot(dev, dev)) / n
        return _fits.Stats(n, mean - shift, var)

    @staticmethod
    def exceed(x, eta: float):
        return x[x > _f32(eta)]

    @staticmethod
    def size(x) -> int:
        return int(x.numel())

    @staticmethod
    def select(a, eta: float):
        return _positions(a >= _f32(eta))

    @staticmethod
    def top1(a):
        return topk_positions(a, 1)

    @staticmethod
    def count_at_least(x, eta: float) -> int:
        return int(torch.count_nonzero(x >= _f32(eta)))

    @staticmethod
    def kth_largest(x, k: int) -> float:
        return float(torch.kthvalue(x, x.numel() - k + 1).values)


def _none(sp, flat, ctx):
    chosen = _positions(flat != 0)
    sp.check_density(int(chosen.numel()), flat.numel(), ctx.name)
    return chosen


def _topk(sp, flat, ctx):
    return topk_positions(flat.abs(), count_for(sp.ratio, flat.numel()))


def _randomk(sp, flat, ctx):
    return torch.from_numpy(sp.positions(flat.numel(), ctx)).to(flat.device)


def _threshold(sp, flat, ctx):
    return _positions(flat.abs() >= _f32(sp.threshold))


def _dgc(sp, flat, ctx):
    d = flat.numel()
    k = count_for(sp.ratio, d)
    if k >= d:
        return torch.arange(d, dtype=torch.int64, device=flat.device)
    magnitudes = flat.abs()
    positions = torch.from_numpy(sample_positions(d, sp.sample_ratio, sp.min_samples, ctx)).to(flat.device)
    sample = magnitudes[positions]
    k_s = sample_count(k, sample.numel(), d)
    cut = torch.topk(sample, k_s, sorted=False).values.min()
    chosen = _positions(magnitudes >= cut)
    if chosen.numel() > k:
        chosen = chosen[topk_positions(magnitudes[chosen], k)]
    return chosen


def _sidco(sp, flat, ctx):
    return sidco_select(TorchOps, flat, sp, ctx)


SELECTORS: Dict[str, Callable] = {
    "none": _none, "topk": _topk, "randomk": _randomk, "threshold": _threshold, "dgc": _dgc, "sidco": _sidco,
}


def select_torch(sparsifier: Sparsifier, flat: torch.Tensor, ctx: EncodeContext) -> torch.Tensor:
    """Positions (ascending ``torch.int64`` on ``flat``'s device) that ``sparsifier`` keeps.

    ``flat`` must be a 1-D floating tensor of finite values (the pipeline sends non-finite
    gradients dense before selecting). A CPU tensor is selected by the core (its C++ kernels)
    on a zero-copy NumPy view; other devices run :func:`select_torch_native`. Stateful
    sparsifiers (SIDCo) update the same per-tensor state as their NumPy ``select``.
    """
    _check_flat(flat)
    if flat.device.type == "cpu":
        view = flat.detach().float().contiguous().numpy()
        return torch.from_numpy(np.ascontiguousarray(sparsifier.select(view, ctx), dtype=np.int64))
    return select_torch_native(sparsifier, flat, ctx)


def select_torch_native(sparsifier: Sparsifier, flat: torch.Tensor, ctx: EncodeContext) -> torch.Tensor:
    """The selection as torch operations on ``flat``'s device: the same positions as the core.

    Sparsifiers without a torch version (third-party components) fall back to their NumPy
    ``select`` on a CPU copy, with a one-time warning naming them; the positions are moved back
    to the tensor's device.
    """
    _check_flat(flat)
    if flat.dtype != torch.float32:
        flat = flat.float()
    fn = SELECTORS.get(sparsifier.id)
    if fn is None or type(sparsifier).select is not _core_select(sparsifier.id):
        host_fallback(f"sparsifier {sparsifier.id!r} (a dense copy goes to the host)")
        chosen = sparsifier.select(flat.detach().cpu().numpy(), ctx)
        return torch.from_numpy(np.ascontiguousarray(chosen, dtype=np.int64)).to(flat.device)
    return fn(sparsifier, flat, ctx)


def _check_flat(flat: torch.Tensor) -> None:
    if flat.dim() != 1 or not flat.dtype.is_floating_point:
        raise DeepReduceError(f"select_torch needs a 1-D floating tensor, got shape {tuple(flat.shape)} "
                              f"and dtype {flat.dtype}")


def _core_select(id_: str):
    """The ``select`` of the built-in class registered as ``id_`` (guards against subclasses)."""
    from .. import registry

    return registry.get_class("sparsifier", id_).select
