"""Error-feedback memories, keyed by tensor name, living in one pipeline instance.

``compensate`` adds what earlier steps failed to send; ``update`` stores the new residual as
the compensated gradient minus exactly what the receiver reconstructs (the decoded container),
so over any run: sum(sent) + final residual == sum(gradients).

The residual is held in float64 and also keeps the rounding of the float32 compensated
gradient handed to the sparsifier (``carry = (g + e) - float32(g + e)``), so nothing is lost
to float32 rounding either: the conservation law holds to float64 precision.
"""
from __future__ import annotations

from typing import Dict

import numpy as np

from .errors import CommunicationError, ConfigError
from .params import Component
from .registry import register


class Memory(Component):
    """Base class: stateless by default."""

    kind = "memory"
    stateful = False

    def compensate(self, name: str, flat: np.ndarray) -> np.ndarray:
        return flat

    def update(self, name: str, compensated: np.ndarray, reconstructed: np.ndarray) -> None:
        """Record what was sent for ``name``; stateless memories ignore it."""

    def reset(self) -> None:
        """Forget every residual."""


@register
class NoMemory(Memory):
    """No error feedback: what a sparsifier drops is lost."""

    id = "none"


@register
class ResidualMemory(Memory):
    """Error feedback: residual = compensated gradient - what the receiver reconstructs."""

    id = "residual"
    stateful = True

    def _validate(self) -> None:
        self._residuals: Dict[str, np.ndarray] = {}
        self._carry: Dict[str, np.ndarray] = {}

    def compensate(self, name, flat):
        residual = self._residuals.get(name)
        if residual is None:
            self._carry.pop(name, None)
            return flat
        if residual.shape != flat.shape:
            raise CommunicationError(
                f"residual memory: tensor {name!r} had {residual.size} elements, now {flat.size}; "
                "a name must keep its size"
            )
        exact = flat.astype(np.float64) + residual
        compensated = exact.astype(flat.dtype)
        self._carry[name] = exact - compensated
        return compensated

    def update(self, name, compensated, reconstructed):
        residual = np.asarray(compensated, dtype=np.float64) - np.asarray(reconstructed, dtype=np.float64)
        carry = self._carry.pop(name, None)
        if carry is not None:
            residual += carry
        self._residuals[name] = residual

    def residual(self, name: str) -> np.ndarray:
        """The residual (float64) currently held for ``name``; None before its first update."""
        return self._residuals.get(name)

    def reset(self):
        self._residuals.clear()
        self._carry.clear()

    def state_dict(self) -> dict:
        """``{"residuals": {name: residual}}`` (copies), for checkpoints."""
        return {"residuals": {name: residual.copy() for name, residual in self._residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Replace every residual with the checkpoint's; errors name a malformed entry."""
        residuals = _checked_keys(self, state, ("residuals",))["residuals"]
        if not isinstance(residuals, dict):
            raise ConfigError(f"memory {self.id!r}: 'residuals' must be a dict of name -> array")
        loaded = {}
        for name, residual in residuals.items():
            array = np.asarray(residual)
            if not isinstance(name, str) or array.ndim != 1 or not np.issubdtype(array.dtype, np.floating):
                raise ConfigError(f"memory {self.id!r}: residual {name!r} must be a 1-D float array, "
                                  f"got {array.dtype} of shape {array.shape}")
            loaded[name] = array.astype(np.float64)
        self.reset()
        self._residuals.update(loaded)


def _checked_keys(component, state, keys) -> dict:
    """``state`` if it is a dict with exactly ``keys``; a ConfigError naming the difference otherwise."""
    if not isinstance(state, dict) or set(state) != set(keys):
        got = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise ConfigError(f"{component.kind} {component.id!r}: checkpoint state must have the keys "
                          f"{list(keys)}, got {got}")
    return state
