"""YAML or dict configs -> validated, fully defaulted config dicts -> pipelines.

A config has the sections ``sparsifier``, ``index``, ``value`` and ``memory``, each
``{id: ..., <parameters>}``, and optionally ``communicator``, ``aggregation``, ``min_numel``, ``nonfinite``,
``threads``, ``max_numel`` and ``warmup``. :func:`load_config` validates every key against the registry and
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

from . import registry
from .backend import parallel
from .errors import ConfigError, quote
from .pipeline import DEFAULT_MIN_NUMEL, NONFINITE_POLICIES, Pipeline, check_numel_option, check_warmup
from .wire import container

REQUIRED_SECTIONS = ("sparsifier", "index", "value", "memory")
OPTIONAL_SECTIONS = ("communicator", "aggregation")
SCALARS = ("min_numel", "nonfinite", "threads", "max_numel", "warmup")
ALLOWED_KEYS = REQUIRED_SECTIONS + OPTIONAL_SECTIONS + SCALARS

ConfigLike = Union[str, os.PathLike, Mapping[str, Any], Pipeline]

#: Limits checked before a config's values are validated or formatted. A shipped config is under
#: 1 KiB, about 20 values deep 3; a YAML alias bomb (anchors nesting anchors) is a few hundred bytes
#: whose value expands to billions of items, so the expanded size is what is bounded.
MAX_CONFIG_BYTES = 64 << 10
MAX_CONFIG_DEPTH = 16
MAX_CONFIG_ITEMS = 10_000


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
                    "while constructing a mapping", node.start_mark, f"found duplicate key {quote(key)}",
                    key_node.start_mark)
        return super().construct_mapping(node, deep)


def _read_yaml(path: str):
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {path!r} is larger than {MAX_CONFIG_BYTES} bytes; a config is a few "
                              "hundred bytes")
        text = raw.decode("utf-8")
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


def check_extent(value, where: str) -> None:
    """Refuse a config value nested deeper than :data:`MAX_CONFIG_DEPTH` or holding more than
    :data:`MAX_CONFIG_ITEMS` items once every shared part (a YAML alias, a Python object reached
    twice) is counted at each place it appears, or holding itself. Work: one visit per distinct
    object (sizes are memoised), so a structure that would expand to billions of items is
    measured, and refused, in time linear in what was read."""
    sizes, open_ = {}, set()

    def size(node, depth: int) -> int:
        if not isinstance(node, (dict, list, tuple, set)):
            return 1
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise ConfigError(f"{where} holds itself (a recursive alias)")
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{where} nests deeper than {MAX_CONFIG_DEPTH} levels")
        open_.add(key)
        total = 1
        for item in (node.items() if isinstance(node, dict) else node):
            total += sum(size(part, depth + 1) for part in item) if isinstance(node, dict) else size(item, depth + 1)
            if total > MAX_CONFIG_ITEMS:
                raise ConfigError(f"{where} expands to more than {MAX_CONFIG_ITEMS} items "
                                  "(YAML aliases counted where they are used)")
        open_.discard(key)
        sizes[key] = total
        return total

    size(value, 0)


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
        check_extent(source, "config")
        return copy.deepcopy(dict(source))
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            if os.sep in path or path.endswith((".yaml", ".yml")):
                raise ConfigError(f"config file {path!r} does not exist")
            path = _shipped_path(path)
        data = _read_yaml(path)
        check_extent(data, f"config file {path!r}")
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
        raise ConfigError(f"config: unknown key {quote(unknown[0])}; allowed keys: {', '.join(ALLOWED_KEYS)}")
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
    _check_chunks(components)
    out["min_numel"] = check_numel_option("config", "min_numel", raw.get("min_numel", DEFAULT_MIN_NUMEL), 0)
    nonfinite = raw.get("nonfinite", "propagate")
    if not isinstance(nonfinite, str) or nonfinite not in NONFINITE_POLICIES:
        raise ConfigError(f"config: 'nonfinite' is {quote(nonfinite)}; allowed: {', '.join(NONFINITE_POLICIES)}")
    out["nonfinite"] = nonfinite
    out["threads"] = parallel.check_threads(raw.get("threads", parallel.AUTO))
    out["max_numel"] = check_numel_option("config", "max_numel", raw.get("max_numel", container.MAX_NUMEL), 1)
    out["warmup"] = check_warmup("config", raw.get("warmup", 0))
    return out, components


def build(source: ConfigLike) -> Pipeline:
    """Build a pipeline from a config path, a shipped config's name, a dict or an existing
    pipeline's config."""
    config, components = _validate(_read(source))
    return Pipeline(
        components["sparsifier"], components["index"], components["value"], components["memory"],
        communicator=components.get("communicator"), aggregation=components.get("aggregation"),
        min_numel=config["min_numel"], nonfinite=config["nonfinite"], threads=config["threads"],
        max_numel=config["max_numel"], warmup=config["warmup"],
    )


def _check_chunks(components: dict) -> None:
    """A chunked sparsifier and a chunk-local index codec must agree on the chunk length: with
    different lengths every container would carry per-chunk counts instead of the geometry
    (docs/chunked.md), a silent cost that is never meant."""
    sparsifier, index = components["sparsifier"], components["index"]
    ours, theirs = getattr(sparsifier, "chunk", None), getattr(index, "chunk", None)
    if ours is not None and theirs is not None and ours != theirs:
        raise ConfigError(f"config: sparsifier {sparsifier.id!r} has chunk {ours} but index {index.id!r} has "
                          f"chunk {theirs}; give both the same chunk")
