"""The gradient corpus of the reproduction experiments: real gradients from real training.

Two models, each trained for a few steps in one process, with the gradient of every parameter
recorded at a few of those steps:

* ``resnet20``: ResNet-20 on the digits images, captured by :func:`experiments.gradients.capture`
  (the benchmarks' capture: SGD with momentum, batch 64, fixed seed), whose runs with
  different step counts share one trajectory, so ``capture(steps=s)`` is the gradient at step
  ``s`` of one training run. The last recorded step reuses the committed
  ``experiments/data/gradients.npz`` when it holds that step. Holds the 36,864-element
  convolutions of DeepReduce Fig. 10 (``layers.*.conv*.weight`` of the last stage).
* ``ncf``: the NCF-style recommender (:mod:`experiments.models.ncf`) on the Zipf
  implicit-feedback data (:mod:`experiments.recsys_data`), Adam. Its embedding gradients are
  inherently sparse (rows of users and items absent from the batch are exactly zero).

The corpus is regenerated deterministically (fixed seeds, one torch thread) in well under a
minute and cached as a compressed ``.npz`` (a few MB), by default under
``$DEEPREDUCE_CACHE`` or ``~/.cache/deepreduce``; nothing binary is shipped in the repository.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from .recsys_data import QUICK as QUICK_DATA
from .recsys_data import ZipfConfig

CORPUS_VERSION = 1
MODELS = ("resnet20", "ncf")


@dataclass(frozen=True)
class CorpusSpec:
    """How the corpus is made: training steps, which steps are recorded, batch sizes, data."""

    resnet_steps: Tuple[int, ...] = (10, 20, 30)   # gradients.capture(steps=s) for each s
    ncf_steps: Tuple[int, ...] = (0, 20, 40)
    ncf_batch: int = 5120                          # about 40% zero entries, like the paper's NCF
    ncf_negatives: int = 4
    ncf_data: ZipfConfig = field(default_factory=ZipfConfig)
    seed: int = 0

    def key(self) -> str:
        """A short digest naming this spec's cache file."""
        text = json.dumps(dict(asdict(self), version=CORPUS_VERSION), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


FULL = CorpusSpec()
QUICK = CorpusSpec(resnet_steps=(1,), ncf_steps=(0, 2), ncf_batch=512, ncf_data=QUICK_DATA)


@dataclass
class Corpus:
    """Recorded gradients: ``grads[model][name]`` has shape ``(len(steps), *param_shape)``."""

    grads: Dict[str, Dict[str, np.ndarray]]
    meta: dict

    def names(self, model: str, min_numel: int = 0) -> List[str]:
        """Parameter names of ``model`` with at least ``min_numel`` elements, in model order."""
        return [n for n in self.meta["order"][model] if self.grads[model][n][0].size >= min_numel]

    def tensors(self, model: str, min_numel: int = 0) -> Iterator[Tuple[str, int, np.ndarray]]:
        """Every recorded ``(name, step, gradient)`` of ``model``."""
        steps = self.meta["steps"][model]
        for name in self.names(model, min_numel):
            for i, step in enumerate(steps):
                yield name, step, self.grads[model][name][i]

    def find(self, model: str, numel: int) -> str:
        """The first parameter of ``model`` with exactly ``numel`` elements (KeyError if none)."""
        for name in self.names(model):
            if self.grads[model][name][0].size == numel:
                return name
        raise KeyError(f"corpus model {model!r} has no parameter with {numel} elements")

    def zero_fraction(self, model: str) -> float:
        """Share of exactly-zero entries over all recorded gradients of ``model``."""
        zeros = sum(int((g == 0).sum()) for g in self.grads[model].values())
        total = sum(g.size for g in self.grads[model].values())
        return zeros / max(1, total)

    def save(self, path: str) -> None:
        arrays = {f"{m}/{n}": g for m in self.grads for n, g in self.grads[m].items()}
        arrays["__meta__"] = np.frombuffer(json.dumps(self.meta).encode(), dtype=np.uint8)
        tmp = f"{path}.tmp.npz"
        np.savez_compressed(tmp, **arrays)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "Corpus":
        with np.load(path) as data:
            meta = json.loads(bytes(data["__meta__"]).decode())
            grads: Dict[str, Dict[str, np.ndarray]] = {m: {} for m in MODELS}
            for key in data.files:
                if key != "__meta__":
                    model, name = key.split("/", 1)
                    grads[model][name] = data[key]
        return cls(grads, meta)


def capture_resnet20(spec: CorpusSpec) -> Dict[str, np.ndarray]:
    """ResNet-20 gradients at each of ``spec.resnet_steps`` via :mod:`experiments.gradients`."""
    from . import gradients

    per_step = []
    for step in spec.resnet_steps:
        grads = None
        if step == gradients.DEFAULT_STEPS and os.path.isfile(gradients.DEFAULT_PATH):
            grads = gradients.load()            # the committed capture of this very step
        if grads is None:
            grads = gradients.capture(steps=step, seed=spec.seed)
        grads.pop("all", None)
        per_step.append(grads)
    return {name: np.stack([g[name] for g in per_step]) for name in per_step[0]}


def capture_ncf(spec: CorpusSpec) -> Dict[str, np.ndarray]:
    """NCF gradients on the Zipf implicit-feedback data (Adam, lr 0.002, BCE loss)."""
    import torch
    from torch.nn import functional as F

    from .models.ncf import NCF
    from .recsys_data import generate

    torch.manual_seed(spec.seed)
    data = generate(spec.ncf_data)
    model = NCF(data.n_users, data.n_items)
    opt = torch.optim.Adam(model.parameters(), lr=0.002)

    def batches():
        epoch = 0
        while True:
            for u, i, lab in data.epoch(epoch, spec.ncf_batch, spec.ncf_negatives, seed=spec.seed):
                yield torch.from_numpy(u), torch.from_numpy(i), torch.from_numpy(lab)
            epoch += 1

    recorded: Dict[str, list] = {n: [] for n, _ in model.named_parameters()}
    stream = batches()
    for step in range(max(spec.ncf_steps) + 1):
        users, items, labels = next(stream)
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(model(users, items), labels).backward()
        if step in spec.ncf_steps:
            for n, p in model.named_parameters():
                recorded[n].append(p.grad.detach().numpy().astype(np.float32, copy=True))
        opt.step()
    return {n: np.stack(v) for n, v in recorded.items()}


def default_cache_dir() -> str:
    return os.environ.get("DEEPREDUCE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "deepreduce")


def build(spec: CorpusSpec = FULL) -> Corpus:
    """Capture a fresh corpus (single process, one torch thread, fixed seeds)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        grads = {"resnet20": capture_resnet20(spec), "ncf": capture_ncf(spec)}
    finally:
        torch.set_num_threads(threads)
    meta = {"version": CORPUS_VERSION, "spec": asdict(spec), "torch": torch.__version__,
            "steps": {"resnet20": list(spec.resnet_steps), "ncf": list(spec.ncf_steps)},
            "order": {m: list(g) for m, g in grads.items()}}
    return Corpus(grads, json.loads(json.dumps(meta)))   # JSON-normal form, as a loaded corpus has


def load(spec: CorpusSpec = FULL, cache_dir: Optional[str] = None, regenerate: bool = False) -> Corpus:
    """The corpus for ``spec``: from the cache when present, else captured and cached."""
    cache_dir = cache_dir or default_cache_dir()
    path = os.path.join(cache_dir, f"corpus-v{CORPUS_VERSION}-{spec.key()}.npz")
    if not regenerate and os.path.isfile(path):
        try:
            return Corpus.load(path)
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache file is rebuilt below
    corpus = build(spec)
    os.makedirs(cache_dir, exist_ok=True)
    corpus.save(path)
    return corpus
