"""The framework-blind part of a compression checkpoint, shared by the torch and TF bindings.

A binding saves ``{"format": STATE_FORMAT, "step": int, "compression": dict}``: its step counter
and what the pipeline (residuals, adaptive state) or summable compressor learned, plus
``"aggregation"`` (the sparse all-reduce's owner residuals and shard bounds) where one runs. The bindings
convert the arrays to their framework's type (deepreduce/torch/checkpoint.py) or keep NumPy
(deepreduce/tensorflow/pipeline.py); :func:`checked_step` is the one check of such a dict.
"""
from __future__ import annotations

from .errors import ConfigError

STATE_FORMAT = 1
STATE_KEYS = ("format", "step", "compression")


def state(step: int, learned: dict, aggregation=None) -> dict:
    """A checkpoint of ``learned`` (and the aggregation's state, when given) at ``step``."""
    out = {"format": STATE_FORMAT, "step": step, "compression": learned}
    if aggregation is not None:
        out["aggregation"] = aggregation
    return out


def checked_step(state: dict, owner: str, aggregation: bool = False) -> int:
    """The step of a checkpoint, after checking its keys (``aggregation``: it must hold the
    aggregation's state too), format and step; errors name ``owner``."""
    expected = set(STATE_KEYS) | ({"aggregation"} if aggregation else set())
    if not isinstance(state, dict) or set(state) != expected:
        got = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise ConfigError(f"{owner}.load_state_dict: expected the keys {sorted(expected)}, got {got}")
    if state["format"] != STATE_FORMAT:
        raise ConfigError(f"{owner}.load_state_dict: checkpoint format {state['format']!r}, "
                          f"this version reads {STATE_FORMAT}")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"{owner}.load_state_dict: 'step' must be a non-negative int, got {step!r}")
    return step
