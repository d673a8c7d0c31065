"""Scalar threshold estimators of SIDCo (Abdelmoniem et al., MLSys 2021, §3), shared by every backend.

A backend (``sidco.ArrayOps`` on any array namespace, ``sidco.NativeOps`` in C++) reduces a vector of magnitudes
to a few float64 statistics (:class:`Stats`); everything after that -- the fitted parameters,
the threshold, the per-stage ratios and the stage adaptation -- is plain Python on floats and
lives only here, so both backends compute the same threshold from the same statistics.

Parameterisations (SIDCo §3.2):

* exponential: ``|G| ~ Exp(beta)``, ``beta = mean``, ``eta = beta * log(1/delta)``;
* gamma: ``|G| ~ Gamma(alpha, beta)``, Minka's closed-form shape estimate, threshold from the
  exact inverse of the regularised upper incomplete gamma function (``exact=True``) or the
  paper's closed-form approximation ``beta * (log(1/delta) - lgamma(alpha))``;
* generalised Pareto: CDF ``1 - (1 + alpha x / beta)^(-1/alpha)`` (scipy ``genpareto(c=alpha)``),
  moment matching ``alpha = (1 - mean^2/var)/2``, ``beta = mean (mean^2/var + 1)/2``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

DISTRIBUTIONS = ("exponential", "gamma", "gpareto")
# Tail model of the later stages for each first-stage model (SIDCo-E, SIDCo-GP, SIDCo-P).
TAIL_OF = {"exponential": "exponential", "gamma": "gpareto", "gpareto": "gpareto"}
ADAPT_MODES = ("paper", "reversed", "flip", "off")

_GP_ALPHA_LIMIT = 0.5 - 1e-6
_GP_EXP_LIMIT = 1e-6


@dataclass(frozen=True)
class Stats:
    """Moments of the (positive) sample a stage fits: count, mean, variance, mean of logs."""

    n: int
    mean: float
    var: float = float("nan")
    mean_log: float = float("nan")


def needs(dist: str) -> tuple:
    """Which statistics a model needs beyond the mean: ``(variance, mean_log)``."""
    return dist == "gpareto", dist == "gamma"


def exponential_threshold(st: Stats, ratio: float) -> Optional[float]:
    """``eta = mean * log(1/ratio)`` (Corollary 1.1 / 2.1); None when the sample is all zero."""
    if st.n == 0 or not st.mean > 0.0:
        return None
    return st.mean * math.log(1.0 / ratio)


def gamma_shape(st: Stats) -> Optional[float]:
    """Minka's closed-form approximation of the Gamma shape MLE (T. Minka, 'Estimating a Gamma distribution', 2002)."""
    if st.n == 0 or not st.mean > 0.0 or not math.isfinite(st.mean_log):
        return None
    s = math.log(st.mean) - st.mean_log
    if not s > 1e-12:        # all magnitudes (nearly) equal: no spread to fit
        return None
    return (3.0 - s + math.sqrt((s - 3.0) ** 2 + 24.0 * s)) / (12.0 * s)


def gamma_threshold(st: Stats, ratio: float, exact: bool = True) -> Optional[float]:
    """Threshold exceeded by a fraction ``ratio`` of a fitted Gamma(alpha, beta)."""
    alpha = gamma_shape(st)
    if alpha is None:
        return None
    beta = st.mean / alpha
    if exact:
        from scipy.special import gammainccinv  # upper-tail inverse: accurate for small ratios

        return beta * float(gammainccinv(alpha, ratio))
    return max(0.0, beta * (math.log(1.0 / ratio) - math.lgamma(alpha)))


def gpareto_threshold(st: Stats, ratio: float) -> Optional[float]:
    """Threshold exceeded by a fraction ``ratio`` of a moment-matched generalised Pareto."""
    if st.n < 2 or not st.mean > 0.0 or not st.var > 0.0:
        return None
    q = st.mean * st.mean / st.var
    alpha = 0.5 * (1.0 - q)
    beta = 0.5 * st.mean * (q + 1.0)
    alpha = min(max(alpha, -_GP_ALPHA_LIMIT), _GP_ALPHA_LIMIT)
    log_inv = math.log(1.0 / ratio)
    if abs(alpha) < _GP_EXP_LIMIT:
        return beta * log_inv
    return beta * math.expm1(alpha * log_inv) / alpha


def threshold(dist: str, st: Stats, ratio: float, exact_gamma: bool = True) -> Optional[float]:
    """The fitted threshold of ``dist`` for ``ratio``, or None if the sample is degenerate."""
    if dist == "exponential":
        return exponential_threshold(st, ratio)
    if dist == "gamma":
        return gamma_threshold(st, ratio, exact_gamma)
    if dist == "gpareto":
        return gpareto_threshold(st, ratio)
    raise ValueError(f"unknown distribution {dist!r}; allowed: {', '.join(DISTRIBUTIONS)}")


def max_stages_for(ratio: float, first_ratio: float) -> int:
    """Default stage cap ``ceil(log2(1/ratio))`` (reference code); 1 when one stage reaches it."""
    if ratio >= first_ratio:
        return 1
    return max(1, int(math.ceil(math.log2(1.0 / ratio))))


def stage_ratio(m: int, stages: int, ratio: float, first_ratio: float) -> float:
    """Ratio of stage ``m`` (1-based) of ``stages``: ``first_ratio``, then an equal geometric split.

    The product over the stages is ``ratio`` (SIDCo's multi-stage fitting, §3.3).
    """
    if stages <= 1 or ratio >= first_ratio:
        return ratio
    if m == 1:
        return first_ratio
    return (ratio / first_ratio) ** (1.0 / (stages - 1))


def remaining_stage_ratio(target: float, exceedances: int, stages_left: int) -> float:
    """Ratio of a later stage: an equal geometric split of ``target / exceedances`` over the
    ``stages_left`` stages still to run (this one included).

    The paper defines ``delta_m = k_m / k_{m-1}``, relative to the exceedances the previous
    stage actually left; with the nominal split of :func:`stage_ratio` an earlier stage's
    miss (say 40% instead of 25% above the first threshold) carries into the final count.
    Returns a value >= 1 when the exceedances are already no more than the target.
    """
    if exceedances <= 0:
        return 1.0
    return (target / exceedances) ** (1.0 / max(1, stages_left))


class StageState:
    """Adaptive stage count of one tensor (Algorithm 1): ``M``, the window sum and count.

    ``flip`` mode also keeps the step direction and the previous window's relative error.
    """

    __slots__ = ("stages", "acc", "cnt", "direction", "last_error")

    def __init__(self, stages: int) -> None:
        self.stages = stages
        self.acc = 0
        self.cnt = 0
        self.direction = 1
        self.last_error = math.inf

    def record(self, step: int, k_hat: int, k: int, period: int, tolerance: float,
               max_stages: int, mode: str) -> None:
        """Account one selection; every ``period`` steps move ``M`` if the mean count is off."""
        if mode == "off":
            return
        if step % period == 0 and self.cnt > 0:
            k_avg = self.acc / self.cnt
            self.stages = adapt_stages(self, k_avg, k, tolerance, max_stages, mode)
            self.acc = 0
            self.cnt = 0
        else:
            self.acc += k_hat
            self.cnt += 1


def adapt_stages(state: StageState, k_avg: float, k: int, tolerance: float, max_stages: int,
                 mode: str) -> int:
    """New stage count from the window mean ``k_avg`` against ``k`` (SIDCo's Algorithm 1).

    ``paper``: too many selected -> one stage fewer, too few -> one more (Algorithm 1 as
    printed). ``reversed``: the opposite. ``flip``: while outside the tolerance step in the
    current direction and reverse it whenever the relative error grew since the last window.
    """
    m = state.stages
    high, low = k_avg > k * (1.0 + tolerance), k_avg < k * (1.0 - tolerance)
    if mode == "paper":
        m += -1 if high else (1 if low else 0)
    elif mode == "reversed":
        m += 1 if high else (-1 if low else 0)
    elif mode == "flip":
        error = abs(k_avg / k - 1.0) if k else 0.0
        if high or low:
            if error > state.last_error:
                state.direction = -state.direction
            m += state.direction
        state.last_error = error
    return min(max(m, 1), max_stages)
