"""Declared, validated constructor parameters for every component.

A component lists its parameters once, as :class:`Param` objects; the shared constructor in
:class:`Component` rejects unknown keys and out-of-range values with an error that names the
key, the component and what is allowed. ``get_config()`` is derived from the same declaration,
so ``build(get_config())`` always round-trips.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from .errors import ConfigError, quote

_MISSING = object()


@dataclass(frozen=True)
class Param:
    """One keyword argument of a component.

    ``kind`` is ``float``, ``int``, ``bool`` or ``str``. ``low``/``high`` bound numbers
    (``low_open``/``high_open`` make a bound exclusive); ``choices`` restricts strings;
    ``finite=False`` lets a float be +-Inf (within the bounds; NaN never passes).
    """

    kind: type
    default: Any = _MISSING
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    choices: Optional[Sequence[Any]] = None
    doc: str = ""
    finite: bool = True

    @property
    def required(self) -> bool:
        return self.default is _MISSING

    def allowed(self) -> str:
        """A human-readable description of the allowed values."""
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.kind in (int, float) and (self.low is not None or self.high is not None):
            lo = "-inf" if self.low is None else repr(self.low)
            hi = "inf" if self.high is None else repr(self.high)
            left = "(" if self.low_open or self.low is None else "["
            right = ")" if self.high_open or self.high is None else "]"
            return f"a {self.kind.__name__} in {left}{lo}, {hi}{right}"
        return f"a {self.kind.__name__}"

    def check(self, owner: str, key: str, value: Any, what: str = "parameter") -> Any:
        """Return ``value`` converted to this parameter's type, or raise ConfigError naming
        ``owner`` and ``what`` ``key`` is (a parameter, a checkpoint field)."""
        where = f"{owner}: {what} {key!r}"
        if self.kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{where} must be true or false, got {quote(value)}")
            return value
        if self.kind is str:
            if not isinstance(value, str):
                raise ConfigError(f"{where} must be a string, got {quote(value)}")
        elif self.kind is int:
            if isinstance(value, bool) or not isinstance(value, (int,)) and not (
                isinstance(value, float) and value.is_integer()
            ):
                raise ConfigError(f"{where} must be an integer, got {quote(value)}")
            value = int(value)
        elif self.kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{where} must be a number, got {quote(value)}")
            value = float(value)
            if math.isnan(value) or (self.finite and not math.isfinite(value)):
                raise ConfigError(f"{where} must be {'finite' if self.finite else 'a number, not NaN'}, "
                                  f"got {quote(value)}")
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{where} is {quote(value)}; allowed: {self.allowed()}")
        if self.kind in (int, float):
            too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
            too_high = self.high is not None and (value >= self.high if self.high_open else value > self.high)
            if too_low or too_high:
                raise ConfigError(f"{where} is {quote(value)}; allowed: {self.allowed()}")
        return value


def resolve(owner: str, declared: Mapping[str, Param], given: Mapping[str, Any]) -> dict:
    """Validate ``given`` against ``declared`` and fill in defaults."""
    unknown = sorted(set(given) - set(declared))
    if unknown:
        allowed = ", ".join(sorted(declared)) or "none"
        raise ConfigError(f"{owner}: unknown parameter {quote(unknown[0])}; allowed parameters: {allowed}")
    out = {}
    for key, param in declared.items():
        if key in given:
            out[key] = param.check(owner, key, given[key])
        elif param.required:
            raise ConfigError(f"{owner}: missing required parameter {key!r} ({param.allowed()})")
        else:
            out[key] = param.default
    return out


class Component:
    """Base of every configurable part: sparsifiers, codecs, memories, communicators.

    Subclasses set ``id`` (the config id), ``kind`` (the registry section) and ``PARAMS``.
    The validated parameters become attributes of the instance.
    """

    id: str = ""
    kind: str = ""
    PARAMS: Mapping[str, Param] = {}

    def __init__(self, **params: Any) -> None:
        values = resolve(f"{self.kind} {self.id!r}", self.PARAMS, params)
        for key, value in values.items():
            setattr(self, key, value)
        self._validate()
        self._init_state()

    def _validate(self) -> None:
        """Hook for cross-parameter checks; raise ConfigError on a bad combination."""

    def _init_state(self) -> None:
        """Hook that creates the instance's own mutable state (residuals, caches, handles),
        after validation; never class-level state."""

    def get_config(self) -> dict:
        """The config dict that rebuilds an equal component."""
        return {"id": self.id, **{key: getattr(self, key) for key in self.PARAMS}}

    def state_dict(self) -> dict:
        """What the component learned while encoding (checkpointed with the training state).

        Stateless components return ``{}``; stateful ones (error-feedback memories, SIDCo's
        adaptive stage counts) return plain Python values and NumPy arrays.
        """
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned; a stateless component accepts only ``{}``."""
        if not isinstance(state, dict):
            raise ConfigError(f"{self.kind} {self.id!r}: checkpoint state must be a dict, got {type(state).__name__}")
        if state:
            raise ConfigError(f"{self.kind} {self.id!r} keeps no state, but the checkpoint holds "
                              f"{quote(sorted(map(str, state)))}")

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash((type(self), repr(sorted(self.get_config().items()))))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.PARAMS)
        return f"{type(self).__name__}({args})"


Validator = Callable[[Any], None]
