"""One registry that maps ``(kind, id)`` to component classes.

Components register themselves with the :func:`register` decorator when their module is
imported; :func:`load_builtin_components` imports every module of the built-in packages, so a
new codec is one new file and nothing else. Index and value codecs also carry a one-byte
``wire_id`` that the container stores; the registry keeps that mapping unique.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Dict, Tuple, Type

from .errors import ConfigError, quote

KINDS = ("sparsifier", "index", "value", "memory", "communicator", "aggregation")
_BUILTIN_PACKAGES = ("sparsify", "index", "values", "collective.comm")
_BUILTIN_MODULES = ("memory", "memory_compact", "collective.aggregation")

_classes: Dict[Tuple[str, str], type] = {}
_wire_ids: Dict[Tuple[str, int], type] = {}
_loaded = False


def register(cls: Type) -> Type:
    """Class decorator: register ``cls`` under ``(cls.kind, cls.id)`` (and its wire id)."""
    if cls.kind not in KINDS:
        raise TypeError(f"{cls.__name__}.kind must be one of {KINDS}, got {cls.kind!r}")
    key = (cls.kind, cls.id)
    if key in _classes and _classes[key] is not cls:
        raise TypeError(f"{cls.kind} id {cls.id!r} registered twice")
    _classes[key] = cls
    wire_id = getattr(cls, "wire_id", None)
    if cls.kind in ("index", "value"):
        if not isinstance(wire_id, int) or not 0 <= wire_id <= 255:
            raise TypeError(f"{cls.__name__} needs an integer wire_id in [0, 255]")
        other = _wire_ids.get((cls.kind, wire_id))
        if other is not None and other is not cls:
            raise TypeError(f"{cls.kind} wire id {wire_id} used by {other.__name__} and {cls.__name__}")
        _wire_ids[(cls.kind, wire_id)] = cls
    return cls


def load_builtin_components() -> None:
    """Import every built-in component module once (they register themselves)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for package in _BUILTIN_PACKAGES:
        pkg = importlib.import_module(f"deepreduce.{package}")
        for info in pkgutil.iter_modules(pkg.__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"deepreduce.{package}.{info.name}")
    for module in _BUILTIN_MODULES:
        importlib.import_module(f"deepreduce.{module}")


def ids(kind: str) -> list:
    """All registered ids of one kind, sorted."""
    load_builtin_components()
    return sorted(i for (k, i) in _classes if k == kind)


def get_class(kind: str, id_: str) -> type:
    """The class registered as ``id_`` in section ``kind``; ConfigError names the allowed ids."""
    load_builtin_components()
    try:
        return _classes[(kind, id_)]
    except KeyError:
        raise ConfigError(
            f"{kind}: unknown id {quote(id_)}; allowed ids: {', '.join(ids(kind))}"
        ) from None


def by_wire_id(kind: str, wire_id: int) -> type:
    """The codec class a container names by its one-byte id."""
    load_builtin_components()
    try:
        return _wire_ids[(kind, wire_id)]
    except KeyError:
        from .errors import ContainerError

        raise ContainerError(f"container names unknown {kind} codec wire id {wire_id}") from None


def create(kind: str, config) -> object:
    """Build one component from ``{id: ..., <params>}`` (or a bare id string)."""
    if isinstance(config, str):
        config = {"id": config}
    if not isinstance(config, dict):
        raise ConfigError(f"{kind}: expected a mapping with an 'id' key, got {quote(config)}")
    if "id" not in config:
        raise ConfigError(f"{kind}: missing 'id'; allowed ids: {', '.join(ids(kind))}")
    if not isinstance(config["id"], str):
        raise ConfigError(f"{kind}: 'id' must be a string, got {quote(config['id'])}; allowed ids: {', '.join(ids(kind))}")
    bad = [key for key in config if not isinstance(key, str)]
    if bad:
        raise ConfigError(f"{kind} {config['id']!r}: parameter names must be strings, got {quote(bad[0])}")
    params = {k: v for k, v in config.items() if k != "id"}
    return get_class(kind, config["id"])(**params)
