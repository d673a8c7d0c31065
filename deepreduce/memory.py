"""Error-feedback memories, keyed by tensor name, living in one pipeline instance.

``compensate`` adds what earlier steps failed to send; ``update`` stores the new residual as
the compensated gradient minus exactly what the receiver reconstructs (the decoded container),
so over any run: sum(sent) + final residual == sum(gradients), up to float rounding.
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

    def compensate(self, name, flat):
        residual = self._residuals.get(name)
        if residual is None:
            return flat
        if residual.shape != flat.shape:
            raise CommunicationError(
                f"residual memory: tensor {name!r} had {residual.size} elements, now {flat.size}; "
                "a name must keep its size"
            )
        return flat + residual

    def update(self, name, compensated, reconstructed):
        self._residuals[name] = (compensated - reconstructed).astype(np.float32, copy=False)

    def residual(self, name: str) -> np.ndarray:
        """The residual currently held for ``name`` (zeros if none yet)."""
        return self._residuals.get(name)

    def reset(self):
        self._residuals.clear()
