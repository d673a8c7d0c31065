"""Real gradients for benchmarks: captured from ResNet-20 training on the embedded digits data.

``capture()`` trains :class:`experiments.models.resnet.ResNet20` single-process (plain SGD with
momentum, the main job's model and data, fixed seeds) for ``steps`` steps and keeps the
gradient of every parameter at the last step, plus ``all`` (every parameter gradient flattened
and concatenated in ``named_parameters`` order: 269,722 values). The ResNet-20 convolutions of
the last stage (``layers.*.conv*.weight``, 64x64x3x3) have the 36,864 elements of DeepReduce's
Fig. 10 micro-benchmark; :data:`DEFAULT_GRADIENT` names one of them.

The file ``experiments/data/gradients.npz`` (float32, compressed, about 1.5 MB) is committed;
``python -m deepreduce capture-gradients`` regenerates it in about a minute on a CPU.
"""
from __future__ import annotations

import os
from typing import Dict, Optional

import numpy as np

DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gradients.npz")
DEFAULT_GRADIENT = "layers.7.conv1.weight"
DEFAULT_STEPS = 30


def capture(steps: int = DEFAULT_STEPS, batch_size: int = 64, seed: int = 0, lr: float = 0.05) -> Dict[str, np.ndarray]:
    """Train ResNet-20 for ``steps`` steps; return the last step's gradients by parameter name."""
    import torch
    from torch.nn import functional as F

    from .digits import load_digits_32
    from .models.resnet import ResNet20

    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ResNet20()
    x_train, y_train, _, _ = load_digits_32()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    x_all, y_all = torch.from_numpy(x_train), torch.from_numpy(y_train)
    model.train()
    for _ in range(steps):
        batch = torch.randint(0, len(y_all), (batch_size,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(model(x_all[batch]), y_all[batch]).backward()
        if _ < steps - 1:
            optimizer.step()
    grads = {name: p.grad.detach().numpy().astype(np.float32).copy()
             for name, p in model.named_parameters() if p.grad is not None}
    grads["all"] = np.concatenate([g.ravel() for g in grads.values()])
    return grads


def save(grads: Dict[str, np.ndarray], path: str = DEFAULT_PATH) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.savez_compressed(path, **grads)
    return path


def load(path: Optional[str] = None) -> Dict[str, np.ndarray]:
    """Every saved gradient by name (float32)."""
    path = path or DEFAULT_PATH
    if not os.path.isfile(path):
        from deepreduce.errors import DeepReduceError

        raise DeepReduceError(
            f"no saved gradients at {path!r}; run `python -m deepreduce capture-gradients` to create them"
        )
    with np.load(path) as data:
        return {name: data[name].astype(np.float32) for name in data.files}


def get(name: str, path: Optional[str] = None) -> np.ndarray:
    """One saved gradient; the error lists the available names."""
    grads = load(path)
    if name not in grads:
        from deepreduce.errors import ConfigError

        raise ConfigError(f"no saved gradient {name!r}; available: {', '.join(sorted(grads))}")
    return grads[name]
