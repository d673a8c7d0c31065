"""Communicators: gather every rank's variable-size container. One module per backend."""
from ._base import Communicator, Handle

__all__ = ["Communicator", "Handle"]
