"""YAML or dict configs -> validated, fully defaulted config dicts -> pipelines.

A config has the sections ``sparsifier``, ``index``, ``value`` and ``memory``, each
``{id: ..., <parameters>}``, and optionally ``communicator``, ``min_numel``, ``nonfinite`` and ``threads``.
:func:`load_config` validates every key against the registry and fills in defaults, so
``build(load_config(p.get_config()))`` equals ``p``.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Mapping, Union

import yaml

from . import parallel, registry
from .errors import ConfigError
from .pipeline import DEFAULT_MIN_NUMEL, NONFINITE_POLICIES, Pipeline

REQUIRED_SECTIONS = ("sparsifier", "index", "value", "memory")
OPTIONAL_SECTIONS = ("communicator",)
SCALARS = ("min_numel", "nonfinite", "threads")
ALLOWED_KEYS = REQUIRED_SECTIONS + OPTIONAL_SECTIONS + SCALARS

ConfigLike = Union[str, os.PathLike, Mapping[str, Any], Pipeline]


def _read(source: ConfigLike) -> dict:
    if isinstance(source, Pipeline):
        return source.get_config()
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist")
        with open(path, "r", encoding="utf-8") as handle:
            try:
                data = yaml.safe_load(handle)
            except yaml.YAMLError as exc:
                raise ConfigError(f"config file {path!r} is not valid YAML: {exc}") from exc
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {path!r} must hold a mapping of sections, got {type(data).__name__}")
        return dict(data)
    raise ConfigError(f"a config is a YAML path, a dict or a Pipeline, got {type(source).__name__}")


def load_config(source: ConfigLike) -> dict:
    """Read and validate a config; returns the normalised dict (every default filled in)."""
    raw = _read(source)
    unknown = sorted(set(raw) - set(ALLOWED_KEYS))
    if unknown:
        raise ConfigError(f"config: unknown key {unknown[0]!r}; allowed keys: {', '.join(ALLOWED_KEYS)}")
    missing = [s for s in REQUIRED_SECTIONS if s not in raw]
    if missing:
        raise ConfigError(f"config: missing section {missing[0]!r}; required sections: {', '.join(REQUIRED_SECTIONS)}")
    out = {}
    for section in REQUIRED_SECTIONS + OPTIONAL_SECTIONS:
        if section in raw and raw[section] is not None:
            out[section] = registry.create(section, raw[section]).get_config()
    min_numel = raw.get("min_numel", DEFAULT_MIN_NUMEL)
    if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
        raise ConfigError(f"config: 'min_numel' must be a non-negative integer, got {min_numel!r}")
    nonfinite = raw.get("nonfinite", "propagate")
    if nonfinite not in NONFINITE_POLICIES:
        raise ConfigError(f"config: 'nonfinite' is {nonfinite!r}; allowed: {', '.join(NONFINITE_POLICIES)}")
    out["min_numel"] = min_numel
    out["nonfinite"] = nonfinite
    out["threads"] = parallel.check_threads(raw.get("threads", parallel.AUTO))
    return out


def build(source: ConfigLike) -> Pipeline:
    """Build a pipeline from a config path, dict or an existing pipeline's config."""
    config = load_config(source)
    components = {s: registry.create(s, config[s]) for s in REQUIRED_SECTIONS + OPTIONAL_SECTIONS if s in config}
    return Pipeline(
        components["sparsifier"], components["index"], components["value"], components["memory"],
        communicator=components.get("communicator"),
        min_numel=config["min_numel"], nonfinite=config["nonfinite"], threads=config["threads"],
    )
