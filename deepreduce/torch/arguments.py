"""The arguments both torch integrations take (``DistributedOptimizer`` and the DDP hook state):
``compression`` and ``named_parameters``, read and checked once."""
from __future__ import annotations

from typing import Dict

import torch

from ..errors import BackendUnavailableError, ConfigError
from ..pipeline import Pipeline
from .pipeline import TorchPipeline, build

# compression=None: gradients travel losslessly (every entry, raw indices and values)
LOSSLESS_CONFIG = {"sparsifier": {"id": "none"}, "index": {"id": "raw"}, "value": {"id": "raw"},
                   "memory": {"id": "none"}}


def is_summable(compression) -> bool:
    """A Horovod-style summable compressor (``compress``/``decompress``, e.g. fp16 or GradiVeQ):
    its codes are summed by all-reduce instead of travelling as containers."""
    return (compression is not None and hasattr(compression, "compress") and hasattr(compression, "decompress")
            and not isinstance(compression, (Pipeline, TorchPipeline)))


def build_pipeline(compression, path: str, spare_buffers: bool = True) -> TorchPipeline:
    """The pipeline of a config (YAML path, name, dict) or built pipeline; None: lossless. Its steps
    are collective (every rank counts them alike; ``spare_buffers``: ``Pipeline.collective_steps``)."""
    pipeline = build(LOSSLESS_CONFIG if compression is None else compression, path=path)
    pipeline.core.collective_steps(spare_buffers)
    return pipeline


def named_parameter_map(named_parameters) -> Dict[torch.Tensor, str]:
    """``{parameter: name}`` from (name, parameter) pairs; a ConfigError for malformed pairs or
    duplicate names."""
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str)
           or not isinstance(item[1], torch.Tensor) for item in named):
        raise ConfigError("named_parameters must be a sequence of (name, parameter) pairs, "
                          "e.g. model.named_parameters()")
    names = [n for n, _ in named]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"named_parameters has duplicate names: {', '.join(duplicates)}")
    return {p: n for n, p in named}


def parameter_names(param_groups, named_parameters) -> Dict[torch.Tensor, str]:
    """Every optimizer parameter's unique name, as Horovod requires (``param.<i>`` without
    ``named_parameters``); errors name the problem."""
    all_params = [p for group in param_groups for p in group["params"]]
    if named_parameters is None:
        return {p: f"param.{i}" for i, p in enumerate(all_params)}
    mapping = named_parameter_map(named_parameters)
    missing = [i for i, p in enumerate(all_params) if p not in mapping]
    if missing:
        raise ConfigError(f"named_parameters does not cover {len(missing)} optimizer parameter(s) "
                          f"(positions {missing[:5]} of the optimizer's parameters)")
    return mapping


def check_ddp_arguments(process_group, per_parameter, summable: bool) -> None:
    """``DeepReduceState``'s own arguments: a ConfigError naming the one that is wrong."""
    import torch.distributed as dist

    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise ConfigError(f"DeepReduceState: process_group must be a torch.distributed.ProcessGroup "
                          f"or None, got {type(process_group).__name__}")
    if not isinstance(per_parameter, bool):
        raise ConfigError(f"DeepReduceState: per_parameter must be True or False, got {per_parameter!r}")
    if not per_parameter and summable:
        raise ConfigError("DeepReduceState: per_parameter=False merges containers; a summable compressor "
                          "already sends each bucket as one all_reduce")


def horovod():
    """``horovod.torch``, or a BackendUnavailableError saying how to build it."""
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise BackendUnavailableError(f"deepreduce.torch.DistributedOptimizer needs horovod.torch: {exc}. "
                                      "Run `make setup` to build Horovod.") from exc
    return hvd
