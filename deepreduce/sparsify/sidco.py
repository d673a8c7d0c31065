"""SIDCo: thresholds from fitted sparsity-inducing distributions (Abdelmoniem et al., MLSys 2021).

The gradient magnitudes are modelled as exponential, gamma or generalised Pareto; a threshold
that a fraction ``ratio`` of them exceeds is computed in closed form from a few moments, in
``stages`` rounds: stage 1 fits all magnitudes for ratio ``first_ratio`` (0.25), each later
stage fits the exceedances of the previous threshold, shifted by it, for an equal geometric
share of the remaining ratio, and the last threshold is applied to the original vector. Every
``period`` (Q = 5) steps the stage count of a tensor moves by one when its mean selected count
left ``[k (1 - tolerance), k (1 + tolerance)]`` (Algorithm 1; ``adapt`` picks the direction,
see ``_fits.adapt_stages``).

The algorithm is written once, in :func:`sidco_select`, over a small set of array operations:
:class:`ArrayOps` on the array namespace (NumPy without the extension, torch tensors on their
device) and :class:`NativeOps` through the C++ kernels (NumPy with the extension), so every
binding makes the same choices from the same float64 statistics.

Engineering choices (where the paper leaves them open): exact zeros are excluded from the first-stage fit (the
ratio is rescaled to the non-zero count; when the target covers every non-zero entry they are
all selected, and when only stage 1's share does, the later stages start from all of them),
the final selection is ``|g| >= eta`` with ``eta`` rounded to float32 once for every binding
and never below the smallest normal float32 (TensorFlow flushes subnormals to zero), a stage with a degenerate sample (fewer than two
exceedances, zero variance) stops the staging at the previous threshold, and an empty
selection falls back to Top-1.
"""
from __future__ import annotations

from typing import Dict

import numpy as np

from .. import checkpoint
from ..backend import _native, arrays, kernels
from ..errors import ConfigError, quote
from ..params import Param
from ..registry import register
from . import _fits
from ._base import Sparsifier, count_for
from .basic import RATIO

# "Every non-zero entry" is |g| >= the smallest normal float32: TensorFlow flushes subnormals to
# zero, so a subnormal threshold would select every entry there and subnormal magnitudes would
# count as non-zero in NumPy but not in TF.
SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)
# The checkpoint fields of a tensor's stage state (_fits.StageState), but ``stages``, whose cap
# is the sparsifier's (SIDCo.load_state_dict).
_STAGE_FIELDS = {"acc": checkpoint.COUNT, "cnt": checkpoint.COUNT,
                 "direction": Param(int, choices=(-1, 1), doc="flip mode's step direction"),
                 "last_error": Param(float, low=0.0, finite=False, doc="flip mode's last relative error")}


def _count_at_least(x, eta: float) -> int:
    """Entries of the magnitudes ``x`` at or above float32 ``eta``."""
    xp = arrays.namespace(x)
    return int(xp.count_nonzero(x >= float(np.float32(eta))))


def _kth_largest(x, k: int) -> float:
    """The ``k``-th largest of the magnitudes ``x`` (``1 <= k <= len(x)``)."""
    return arrays.adapter(x).kth_largest(x, k)


def _sum64(x) -> float:
    """The sum of ``x`` accumulated in float64."""
    xp = arrays.namespace(x)
    return float(xp.sum(x, dtype=xp.float64))


def _sq_dev64(x, mean: float) -> float:
    """``sum((x - mean)^2)`` in float64."""
    xp = arrays.namespace(x)
    dev = xp.astype(x, xp.float64) - mean
    return float(xp.sum(dev * dev))


class ArrayOps:
    """The array operations :func:`sidco_select` needs, on float32 vectors of any array
    namespace (NumPy without the C++ extension, torch tensors on their device); float64
    accumulation, float32 comparisons."""

    @staticmethod
    def magnitudes(flat):
        return arrays.namespace(flat).abs(flat)

    @staticmethod
    def first_stats(a, need_var: bool, need_log: bool) -> _fits.Stats:
        """Moments of the non-zero magnitudes (float64 accumulation)."""
        xp = arrays.namespace(a)
        n = int(xp.count_nonzero(a))
        if n == 0:
            return _fits.Stats(0, 0.0)
        mean = _sum64(a) / n
        var = mean_log = float("nan")
        if need_var:   # the zeros contributed (0 - mean)^2 each; remove them
            var = (_sq_dev64(a, mean) - (a.shape[0] - n) * mean * mean) / n
        if need_log:
            positive = a[a > 0]
            mean_log = float(xp.sum(xp.log(xp.astype(positive, xp.float64)))) / n
        return _fits.Stats(n, mean, var, mean_log)

    @staticmethod
    def tail_stats(x, shift: float, need_var: bool) -> _fits.Stats:
        """Moments of ``x - shift`` (``x`` all above ``shift``): the mean moves, the variance does not."""
        n = int(x.shape[0])
        if n == 0:
            return _fits.Stats(0, 0.0)
        mean = _sum64(x) / n
        var = _sq_dev64(x, mean) / n if need_var else float("nan")
        return _fits.Stats(n, mean - shift, var)

    @staticmethod
    def exceed(x, eta: float):
        return x[x > float(np.float32(eta))]

    @staticmethod
    def size(x) -> int:
        return int(x.shape[0])

    @staticmethod
    def select(a, eta: float):
        return kernels.threshold_positions(a, eta)

    @staticmethod
    def top1(a):
        return kernels.topk_positions(a, 1)

    count_at_least = staticmethod(_count_at_least)
    kth_largest = staticmethod(_kth_largest)


class NativeOps:
    """The same operations through the C++ kernels (``deepreduce._sidco``): the vectors stay
    signed and every kernel takes magnitudes on the fly, so no ``|g|`` copy is made, and the
    statistics take one pass. Same float64 statistics and float32 comparisons as ArrayOps."""

    def __init__(self, module) -> None:
        self.m = module

    @staticmethod
    def magnitudes(flat):
        return np.ascontiguousarray(flat, dtype=np.float32)

    def first_stats(self, a, need_var: bool, need_log: bool) -> _fits.Stats:
        n, total, logs = self.m.abs_stats(a, need_log)
        if n == 0:
            return _fits.Stats(0, 0.0)
        mean = total / n
        var = self.m.abs_sq_dev(a, mean) / n if need_var else float("nan")
        return _fits.Stats(n, mean, var, logs / n if need_log else float("nan"))

    def tail_stats(self, x, shift: float, need_var: bool) -> _fits.Stats:
        n, total, _ = self.m.abs_stats(x, False)
        if x.size == 0:
            return _fits.Stats(0, 0.0)
        mean = total / x.size
        var = self.m.abs_sq_dev(x, mean) / x.size if need_var else float("nan")
        return _fits.Stats(int(x.size), mean - shift, var)

    def exceed(self, x, eta: float):
        return self.m.abs_exceed(x, float(np.float32(eta)))

    @staticmethod
    def size(x) -> int:
        return int(x.size)

    def select(self, a, eta: float):
        return self.m.abs_select(a, float(np.float32(eta)))

    @staticmethod
    def top1(a):
        return kernels.topk_positions(a, 1)

    # the exceedance vectors are NumPy magnitudes here too (abs_exceed returns |x|)
    count_at_least = staticmethod(_count_at_least)
    kth_largest = staticmethod(_kth_largest)


def sidco_threshold(ops, a, sparsifier: "SIDCo", stages: int) -> tuple:
    """Run the staged fit on magnitudes ``a``; return ``(eta, stages actually used, exact)``.

    ``eta`` is already rounded to float32 (as every binding compares in float32); ``exact``
    says whether the tail check replaced the fitted threshold (:func:`checked_tail_threshold`).
    """
    dist, tail = sparsifier.distribution, _fits.TAIL_OF[sparsifier.distribution]
    exact = sparsifier.gamma_inverse == "exact"
    d = ops.size(a)
    eta, used, x, tails = 0.0, 0, a, []
    for m in range(1, stages + 1):
        if m == 1:
            dm = _fits.stage_ratio(m, stages, sparsifier.ratio, sparsifier.first_ratio)
            need_var, need_log = _fits.needs(dist)
            st = ops.first_stats(a, need_var, need_log)
            if st.n == 0:
                return float("inf"), 0, False     # all zero: nothing reaches any threshold
            if sparsifier.ratio * d >= st.n:      # the target covers every non-zero entry
                return SMALLEST_NORMAL, 1, False
            dm_nonzero = dm * d / st.n            # zeros never exceed: rescale to the non-zeros
            if dm_nonzero >= 1.0:                 # stage 1's share covers every non-zero entry:
                eta = 0.0                         # the later stages start from all of them
            else:
                t = _fits.threshold(dist, st, dm_nonzero, exact)
                if t is None:                     # all non-zero magnitudes equal
                    return float(np.float32(st.mean)), 1, False
                eta = t
        else:
            dm = _fits.remaining_stage_ratio(sparsifier.ratio * d, ops.size(x), stages - m + 1)
            if dm >= 1.0:                         # the exceedances are already no more than k
                break
            st = ops.tail_stats(x, eta, _fits.needs(tail)[0])
            t = _fits.threshold(tail, st, dm, exact)
            if t is None:
                break
            eta = eta + t
        used = m
        if m < stages:
            x = ops.exceed(x, eta)
            tails.append(x)
            if ops.size(x) < 2:
                break
    eta = fitted = float(np.float32(max(eta, SMALLEST_NORMAL)))   # never 0: zeros are not sent
    if sparsifier.tail_check and tails:
        eta = checked_tail_threshold(ops, tails, eta, count_for(sparsifier.ratio, d), sparsifier.tolerance)
    return eta, used, eta != fitted


def checked_tail_threshold(ops, tails: list, eta: float, k: int, tolerance: float) -> float:
    """The staged threshold ``eta``, or an exact ``k``-th largest magnitude when it misses.

    ``tails`` are the exceedance sets the stages computed, largest first; the last one holds
    every magnitude above a threshold no higher than ``eta`` and is small (about
    ``k / delta_M`` entries), so the final count ``|{j: |g_j| >= eta}|`` is known from it
    alone. When that count falls outside ``[k (1 - tolerance), k (1 + tolerance)]`` -- the
    fitted tail model does not describe the few dozen to few thousand largest magnitudes of a
    real layer well enough -- the threshold becomes the ``k``-th largest entry of the newest
    set holding at least ``k`` entries (a partial sort of that set, not of the gradient).
    """
    count = ops.count_at_least(tails[-1], eta)
    if k * (1.0 - tolerance) <= count <= k * (1.0 + tolerance):
        return eta
    for x in reversed(tails):
        if ops.size(x) >= k:
            return float(np.float32(ops.kth_largest(x, k)))
    return eta


def sidco_select(ops, flat, sparsifier: "SIDCo", ctx):
    """Positions SIDCo selects in ``flat`` (ascending), updating the tensor's stage state."""
    state = sparsifier.stage_state(ctx.name)
    a = ops.magnitudes(flat)
    eta, used, exact = sidco_threshold(ops, a, sparsifier, state.stages)
    chosen = ops.select(a, eta)
    k_hat = ops.size(chosen)
    if k_hat == 0 and ops.size(a) > 0:
        chosen = ops.top1(a)
    k = count_for(sparsifier.ratio, ops.size(a))
    state.record(ctx.step, k_hat, k, sparsifier.period, sparsifier.tolerance,
                 sparsifier.stage_cap(), sparsifier.adapt)
    sparsifier.last = {"name": ctx.name, "step": ctx.step, "threshold": eta, "stages": used,
                       "exact_tail": exact, "k_hat": k_hat, "k": k}
    return chosen


@register
class SIDCo(Sparsifier):
    """Multi-stage threshold estimation from a sparsity-inducing distribution (SIDCo).

    ``distribution``: ``exponential`` (SIDCo-E), ``gamma`` (gamma first stage, generalised
    Pareto later: SIDCo-GP) or ``gpareto`` (SIDCo-P). ``stages`` is the initial stage count;
    ``adapt`` how it moves (``paper``: Algorithm 1 as printed; ``reversed``; ``flip``: reverse
    the step whenever the error grew; ``off``: fixed). ``max_stages`` 0 means
    ``ceil(log2(1/ratio))``. State (stage count and window) is kept per tensor name.
    """

    id = "sidco"
    PARAMS = {
        "ratio": RATIO,
        "distribution": Param(str, default="exponential", choices=_fits.DISTRIBUTIONS,
                              doc="first-stage model"),
        "stages": Param(int, default=1, low=1, high=64, doc="initial number of stages"),
        "max_stages": Param(int, default=0, low=0, high=64, doc="stage cap; 0: ceil(log2(1/ratio))"),
        "first_ratio": Param(float, default=0.25, low=0.0, high=1.0, low_open=True, high_open=True,
                             doc="ratio of the first stage when there are several"),
        "adapt": Param(str, default="paper", choices=_fits.ADAPT_MODES, doc="stage adaptation rule"),
        "period": Param(int, default=5, low=1, high=2**62, doc="adaptation period Q in steps"),
        "tolerance": Param(float, default=0.2, low=0.0, high=1.0, low_open=True, high_open=True,
                           doc="allowed relative deviation of the mean count from the target"),
        "gamma_inverse": Param(str, default="exact", choices=("exact", "approx"),
                               doc="gamma threshold: exact inverse or the paper's closed form"),
        "tail_check": Param(bool, default=True,
                            doc="with 2+ stages, replace a last-stage threshold whose count misses "
                                "k by more than 'tolerance' with the exact k-th largest exceedance"),
    }

    def _validate(self) -> None:
        if self.max_stages and self.stages > self.max_stages:
            raise ConfigError(f"sparsifier 'sidco': 'stages' ({self.stages}) exceeds 'max_stages' "
                              f"({self.max_stages})")

    def _init_state(self) -> None:
        self._states: Dict[str, _fits.StageState] = {}
        self.last: dict = {}

    def stage_cap(self) -> int:
        """The largest stage count adaptation may reach."""
        return self.max_stages or _fits.max_stages_for(self.ratio, self.first_ratio)

    def stage_state(self, name: str) -> _fits.StageState:
        """The adaptive stage state of tensor ``name`` (created at ``stages``, capped)."""
        state = self._states.get(name)
        if state is None:
            state = self._states[name] = _fits.StageState(min(self.stages, max(self.stage_cap(), 1)))
        return state

    def reset(self) -> None:
        """Forget every tensor's stage state."""
        self._states.clear()

    def state_dict(self) -> dict:
        """Every tensor's adaptive stage state, ``{"tensors": {name: {slot: value}}}``."""
        return {"tensors": {name: {slot: getattr(state, slot) for slot in _fits.StageState.__slots__}
                            for name, state in self._states.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore the stage states :meth:`state_dict` returned, each field checked
        (:mod:`deepreduce.checkpoint`): a stage count beyond this config's cap would make every
        later encode fit that many stages."""
        tensors = checkpoint.checked_keys("sparsifier 'sidco'", state, ("tensors",))["tensors"]
        if not isinstance(tensors, dict):
            raise ConfigError("sparsifier 'sidco': checkpoint state must be {'tensors': {name: stage state}}")
        fields = dict(_STAGE_FIELDS, stages=Param(int, low=1, high=max(self.stage_cap(), 1)))
        loaded = {}
        for name, slots in tensors.items():
            if not isinstance(name, str):
                raise ConfigError(f"sparsifier 'sidco': checkpoint tensor names must be strings, got {quote(name)}")
            values = checkpoint.checked_fields(f"sparsifier 'sidco' stage state of {quote(name)}", slots, fields)
            loaded[name] = _fits.StageState(values["stages"])
            for slot, value in values.items():
                setattr(loaded[name], slot, value)
        self._states = loaded

    @property
    def backend(self) -> str:
        """``"c++"`` when the ``deepreduce._sidco`` kernels run, else ``"numpy"``."""
        return "numpy" if _native.load("sidco") is None else "c++"

    array_api = True

    def select(self, flat, ctx):
        module = _native.load("sidco") if type(flat) is np.ndarray else None
        return sidco_select(ArrayOps if module is None else NativeOps(module), flat, self, ctx)
