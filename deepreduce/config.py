"""YAML or dict configs -> validated, fully defaulted config dicts -> pipelines.

A config has the sections ``sparsifier``, ``index``, ``value`` and ``memory``, each
``{id: ..., <parameters>}``, and optionally ``communicator``, ``aggregation``, ``min_numel``, ``nonfinite``,
``threads`` and ``max_numel``. :func:`load_config` validates every key against the registry and
fills in defaults, so ``build(load_config(p.get_config()))`` equals ``p``. Whatever the input
(a YAML file that is not UTF-8, duplicate keys, an empty section, a list where an id belongs),
the only error is a ConfigError naming the problem.
"""
from __future__ import annotations

import copy
import importlib.resources
import os
from typing import Any, List, Mapping, Tuple, Union

import yaml

from .wire import container
from .backend import parallel
from . import registry
from .errors import ConfigError
from .pipeline import DEFAULT_MIN_NUMEL, NONFINITE_POLICIES, Pipeline, check_numel_option

REQUIRED_SECTIONS = ("sparsifier", "index", "value", "memory")
OPTIONAL_SECTIONS = ("communicator", "aggregation")
SCALARS = ("min_numel", "nonfinite", "threads", "max_numel")
ALLOWED_KEYS = REQUIRED_SECTIONS + OPTIONAL_SECTIONS + SCALARS

ConfigLike = Union[str, os.PathLike, Mapping[str, Any], Pipeline]


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping repeating a key (plain YAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                repeated = key in seen
                seen.add(key)
            except TypeError:   # an unhashable key: construct_mapping reports it
                continue
            if repeated:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}",
                    key_node.start_mark)
        return super().construct_mapping(node, deep)


def _read_yaml(path: str):
    try:
        with open(path, "rb") as handle:
            text = handle.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not UTF-8 text: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"config file {path!r} cannot be read: {exc}") from exc
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r} is not valid YAML: {exc}") from exc
    except RecursionError as exc:
        raise ConfigError(f"config file {path!r} nests too deeply") from exc


def shipped_configs() -> List[str]:
    """Names of the configs shipped with the package (``deepreduce/configs/*.yaml``), sorted."""
    folder = importlib.resources.files(__package__).joinpath("configs")
    return sorted(entry.name[:-5] for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def _shipped_path(name: str) -> str:
    """The file of shipped config ``name`` (a plain name: no folder, no suffix)."""
    entry = importlib.resources.files(__package__).joinpath("configs", f"{name}.yaml")
    if not entry.is_file():
        raise ConfigError(f"config {name!r} is neither a file nor a shipped config; shipped configs: "
                          f"{', '.join(shipped_configs())}")
    return os.fspath(entry)


def _read(source: ConfigLike) -> dict:
    if isinstance(source, Pipeline):
        return source.get_config()
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            if os.sep in path or path.endswith((".yaml", ".yml")):
                raise ConfigError(f"config file {path!r} does not exist")
            path = _shipped_path(path)
        data = _read_yaml(path)
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {path!r} must hold a mapping of sections, got {type(data).__name__}")
        return dict(data)
    raise ConfigError(f"a config is a YAML path, a dict or a Pipeline, got {type(source).__name__}")


def load_config(source: ConfigLike) -> dict:
    """Read and validate a config; returns the normalised dict (every default filled in).

    ``source`` is a YAML path, the name of a shipped config (``"topk_raw"``, see
    :func:`shipped_configs`), a dict or a Pipeline.
    """
    return _validate(_read(source))[0]


def _validate(raw: dict) -> Tuple[dict, dict]:
    """(normalised config, the components it built): each component is built once, here."""
    unknown = [key for key in raw if key not in ALLOWED_KEYS]
    if unknown:
        raise ConfigError(f"config: unknown key {unknown[0]!r}; allowed keys: {', '.join(ALLOWED_KEYS)}")
    missing = [s for s in REQUIRED_SECTIONS if s not in raw]
    if missing:
        raise ConfigError(f"config: missing section {missing[0]!r}; required sections: {', '.join(REQUIRED_SECTIONS)}")
    empty = [s for s in REQUIRED_SECTIONS if raw[s] is None]
    if empty:
        raise ConfigError(f"config: section {empty[0]!r} is empty; it needs an id (allowed ids: "
                          f"{', '.join(registry.ids(empty[0]))})")
    out, components = {}, {}
    for section in REQUIRED_SECTIONS + OPTIONAL_SECTIONS:
        if section in raw and raw[section] is not None:
            components[section] = registry.create(section, raw[section])
            out[section] = components[section].get_config()
    out["min_numel"] = check_numel_option("config", "min_numel", raw.get("min_numel", DEFAULT_MIN_NUMEL), 0)
    nonfinite = raw.get("nonfinite", "propagate")
    if not isinstance(nonfinite, str) or nonfinite not in NONFINITE_POLICIES:
        raise ConfigError(f"config: 'nonfinite' is {nonfinite!r}; allowed: {', '.join(NONFINITE_POLICIES)}")
    out["nonfinite"] = nonfinite
    out["threads"] = parallel.check_threads(raw.get("threads", parallel.AUTO))
    out["max_numel"] = check_numel_option("config", "max_numel", raw.get("max_numel", container.MAX_NUMEL), 1)
    return out, components


def build(source: ConfigLike) -> Pipeline:
    """Build a pipeline from a config path, a shipped config's name, a dict or an existing
    pipeline's config."""
    config, components = _validate(_read(source))
    return Pipeline(
        components["sparsifier"], components["index"], components["value"], components["memory"],
        communicator=components.get("communicator"), aggregation=components.get("aggregation"),
        min_numel=config["min_numel"], nonfinite=config["nonfinite"], threads=config["threads"],
        max_numel=config["max_numel"],
    )
