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

from .errors import CommunicationError
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
