"""The arguments of :class:`deepreduce.torch.diloco.DiLoCo`, checked once: a ConfigError names
the one that is wrong."""
from __future__ import annotations

from typing import List

import torch

from ..errors import ConfigError

OWNER = "DiLoCo"


def trainable(model) -> List[tuple]:
    """``model``'s trainable (name, parameter) pairs, on one device."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"{OWNER}: model must be a torch.nn.Module, got {type(model).__name__}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ConfigError(f"{OWNER}: the model has no trainable parameters")
    if len({p.device for _, p in named}) > 1:
        raise ConfigError(f"{OWNER}: the model's parameters are on several devices "
                          f"({sorted(str(p.device) for p in {p.device for _, p in named})}); one device is supported")
    return named


def check_optimizers(inner, outer, params) -> None:
    """Two torch optimizers; the outer one holds exactly ``params`` (torchft's shape)."""
    for what, opt in (("inner_optimizer", inner), ("outer_optimizer", outer)):
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"{OWNER}: {what} must be a torch.optim.Optimizer, got {type(opt).__name__}")
    if inner is outer:
        raise ConfigError(f"{OWNER}: inner_optimizer and outer_optimizer must be two optimizers")
    held = {id(p) for group in outer.param_groups for p in group["params"]}
    if held != {id(p) for p in params}:
        raise ConfigError(f"{OWNER}: outer_optimizer must hold exactly the model's trainable parameters "
                          f"(it holds {len(held)}, the model has {len(params)}); build it as "
                          "torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)")


def check_flat(flat) -> None:
    """``flat`` is a bool (one flat tensor per fragment, or its parameters' own)."""
    if not isinstance(flat, bool):
        raise ConfigError(f"{OWNER}: flat must be True or False, got {flat!r}")


def hyperparameters(optimizer) -> str:
    """The outer optimizer's settings (every group's, without its parameters), for the agreement."""
    return repr([{k: v for k, v in sorted(group.items()) if k != "params"} for group in optimizer.param_groups])
