"""GradiVeQ: PCA vector quantisation whose codes can be summed (Yu, Lin et al., NeurIPS 2018).

Framework-neutral math (NumPy); ``deepreduce.torch.GradiVeQ`` applies it to torch tensors
inside Horovod's allreduce, ``deepreduce.tensorflow.GradiVeQ`` to TensorFlow tensors (through
:class:`SampleWindow` and the functions here, in graph ops).

A conv-layer gradient is flattened so that the ``F`` filters' gradients at one (h, w, depth)
position are adjacent (torch ``(F, D, H, W)`` -> ``(H, W, D, F)``), and cut into slices of
``K`` entries. A linear compressor ``U`` (``K x d``, top-``d`` principal directions) is trained
from aggregated, uncompressed gradients: ``d`` is the smallest count whose eigenvalues keep
more than ``1 - loss`` of the variance (eq. 6). With ``reuse = s`` slices share one ``U``
trained on the first slice of the group (``s = 0``: the whole layer, the paper's ``s = inf``);
every slice keeps its own mean ``mu_m``.

Compression is linear, ``c_n = U^T g_n``, so codes of several ranks are summed (or averaged)
by an ordinary allreduce. Decompression is affine: ``g_hat = U c + (mu - U U^T mu)``, which
equals the paper's ``U (U^T (g - mu)) + mu`` for the aggregated gradient ``g`` -- centering
is applied after aggregation, so the compressor needs to know neither the number of ranks
nor whether the allreduce sums or averages (``mu`` is learnt from the allreduce's own
outputs, so it lives in the same domain). Splitting the affine part as ``offset / N`` per rank
gives the paper's identity: decompressing the summed codes equals the sum of the ranks'
decompressions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ConfigError, size_text

LAYOUTS = ("torch", "tf")
#: The most memory one tensor's sampling window may take (:func:`window_bytes`): the window keeps
#: ``sample_iters`` float64 copies of each group's first slice and a float64 running sum of
#: every slice, so ``reuse = 1`` with a large ``sample_iters`` on a large layer asks for
#: ``8 sample_iters`` bytes per element (a 25M-element layer at the paper's 100 samples: 20 GB).
MAX_WINDOW_BYTES = 4 << 30


@dataclass(frozen=True)
class SlicePlan:
    """How one tensor is sliced: slice size ``K``, slice count, group size and layout."""

    shape: Tuple[int, ...]
    slice_size: int
    n_slices: int
    group: int          # slices per compressor
    layout: str

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    @property
    def sliced(self) -> int:
        """Entries covered by slices; the rest (the tail) travels uncompressed."""
        return self.n_slices * self.slice_size

    @property
    def groups(self) -> List[Tuple[int, int]]:
        """``(first slice, slice count)`` of each compressor's group."""
        return [(s, min(self.group, self.n_slices - s)) for s in range(0, self.n_slices, self.group)]


def slice_plan(shape: Sequence[int], layout: str = "torch", slice_size: int = 0, max_slice: int = 4096,
               min_numel: int = 1024, reuse: int = 0) -> Optional[SlicePlan]:
    """The slicing of a tensor of ``shape``, or None when it travels uncompressed.

    Automatic ``K`` (``slice_size = 0``; 4-D conv kernels only, spec Part III.3 item 6):
    ``3 F D`` when it divides the size, else ``F D``, else the largest ``F j`` (``j`` dividing
    ``D``) not above ``max_slice``. A given ``slice_size`` applies to any tensor. Tensors below
    ``min_numel`` entries or with fewer than one slice travel uncompressed.
    """
    if layout not in LAYOUTS:
        raise ConfigError(f"GradiVeQ: 'layout' is {layout!r}; allowed: {', '.join(LAYOUTS)}")
    shape = tuple(int(s) for s in shape)
    numel = int(np.prod(shape)) if shape else 1
    if numel < max(min_numel, 1):
        return None
    if slice_size:
        k = slice_size
    else:
        if len(shape) != 4:
            return None
        f, depth = (shape[0], shape[1]) if layout == "torch" else (shape[3], shape[2])
        k = 0
        for cand in (3 * f * depth, f * depth):
            if cand <= max_slice and numel % cand == 0:
                k = cand
                break
        if not k:
            fits = [f * j for j in range(depth, 0, -1) if depth % j == 0 and f * j <= max_slice]
            k = fits[0] if fits else 0
        if not k:
            return None
    n_slices = numel // k
    if n_slices < 1 or k < 2:
        return None
    group = n_slices if reuse == 0 else min(reuse, n_slices)
    return SlicePlan(shape, k, n_slices, group, layout)


def window_bytes(plan: SlicePlan, sample_iters: int) -> int:
    """Bytes of a full sampling window of ``plan``: ``sample_iters`` float64 first slices per
    group (:class:`SampleWindow` and the torch and TF adapters keep the same) and the float64
    running sum of every slice."""
    groups = -(-plan.n_slices // plan.group)
    return 8 * plan.slice_size * (sample_iters * groups + plan.n_slices)


def slice_order(shape: Sequence[int], layout: str) -> Optional[Tuple[int, ...]]:
    """Axis permutation that puts a tensor in slicing order (None: already in order)."""
    if len(shape) == 4 and layout == "torch":
        return (2, 3, 1, 0)      # (F, D, H, W) -> (H, W, D, F)
    return None


def inverse(perm: Tuple[int, ...]) -> Tuple[int, ...]:
    out = [0] * len(perm)
    for i, p in enumerate(perm):
        out[p] = i
    return tuple(out)


def to_slices(array: np.ndarray, plan: SlicePlan) -> Tuple[np.ndarray, np.ndarray]:
    """``(slices (n_slices x K), tail)`` of ``array`` in slicing order."""
    perm = slice_order(plan.shape, plan.layout)
    flat = (np.transpose(array, perm) if perm else np.asarray(array)).reshape(-1)
    return flat[: plan.sliced].reshape(plan.n_slices, plan.slice_size), flat[plan.sliced:]


def from_slices(slices: np.ndarray, tail: np.ndarray, plan: SlicePlan) -> np.ndarray:
    """Inverse of :func:`to_slices`."""
    flat = np.concatenate([slices.reshape(-1), tail])
    perm = slice_order(plan.shape, plan.layout)
    if perm is None:
        return flat.reshape(plan.shape)
    permuted_shape = tuple(plan.shape[p] for p in perm)
    return np.transpose(flat.reshape(permuted_shape), inverse(perm))


def compressed_dim(eigenvalues: np.ndarray, loss: float) -> int:
    """Smallest ``d`` keeping more than ``1 - loss`` of the variance (eq. 6); at least 1."""
    total = float(np.sum(eigenvalues))
    if not total > 0.0:
        return 1
    kept = np.cumsum(eigenvalues) / total
    return int(min(np.searchsorted(kept, 1.0 - loss, side="right") + 1, eigenvalues.size))


def train_pca(samples: np.ndarray, loss: float) -> Tuple[np.ndarray, np.ndarray]:
    """``(U_d (K x d), eigenvalues)`` from ``L_t x K`` aggregated slice samples.

    Thin SVD of the centred samples in float64 (the cheaper form when
    ``L_t < K``). Each direction's sign is fixed (largest-magnitude entry positive, first one
    on ties) so equal inputs give the same ``U`` however LAPACK orients its vectors.
    """
    x = np.asarray(samples, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"PCA needs at least two samples of one slice, got shape {x.shape}")
    centred = x - x.mean(axis=0)
    _, s, vt = np.linalg.svd(centred, full_matrices=False)
    eig = s * s / (x.shape[0] - 1)
    d = compressed_dim(eig, loss)
    u = vt[:d].T.copy()
    pivots = np.argmax(np.abs(u), axis=0)
    signs = np.sign(u[pivots, np.arange(d)])
    signs[signs == 0] = 1.0
    return u * signs, eig


@dataclass
class GroupModel:
    """One compressor: ``U`` (float32, ``K x d``) for slices ``[start, start + count)``."""

    start: int
    count: int
    u: Optional[np.ndarray]      # None: the group travels uncompressed (d would not shrink it)

    @property
    def width(self) -> int:
        """Code length per slice."""
        return self.u.shape[1] if self.u is not None else -1


@dataclass
class Model:
    """A trained GradiVeQ model of one tensor: per-group compressors and per-slice offsets."""

    plan: SlicePlan
    groups: List[GroupModel]
    offset: np.ndarray           # float32, n_slices x K: mu - U U^T mu per slice
    dims: List[int] = field(default_factory=list)

    @property
    def code_size(self) -> int:
        """Length of the compressed vector (codes, uncompressed groups, tail)."""
        size = self.plan.numel - self.plan.sliced
        for g in self.groups:
            size += g.count * (g.width if g.u is not None else self.plan.slice_size)
        return size


def train(plan: SlicePlan, first_slice_samples: Sequence[np.ndarray], slice_mean: np.ndarray,
          loss: float) -> Model:
    """Train every group's compressor from its first slice's samples; per-slice means given.

    ``first_slice_samples[i]`` is ``L_t x K`` for group ``i``; ``slice_mean`` is
    ``n_slices x K`` (the mean of each slice over the same ``L_t`` aggregated gradients).
    """
    groups, dims = [], []
    mean = np.asarray(slice_mean, dtype=np.float64)
    offset = mean.copy()
    for (start, count), samples in zip(plan.groups, first_slice_samples):
        u, _ = train_pca(samples, loss)
        dims.append(u.shape[1])
        if u.shape[1] >= plan.slice_size:
            groups.append(GroupModel(start, count, None))
            offset[start:start + count] = 0.0
            continue
        u32 = u.astype(np.float32)
        u64 = u32.astype(np.float64)
        block = mean[start:start + count]
        offset[start:start + count] = block - (block @ u64) @ u64.T
        groups.append(GroupModel(start, count, u32))
    return Model(plan, groups, offset.astype(np.float32), dims)


def compress(model: Model, slices: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """The summable code of one gradient (1-D float32): ``U^T`` per slice, raw groups, tail."""
    parts = []
    for g in model.groups:
        block = slices[g.start:g.start + g.count]
        parts.append((block @ g.u if g.u is not None else block).reshape(-1))
    parts.append(tail)
    return np.concatenate(parts).astype(np.float32, copy=False)


def decompress(model: Model, code: np.ndarray, parts: int = 1) -> Tuple[np.ndarray, np.ndarray]:
    """``(slices, tail)`` reconstructed from an aggregated code.

    ``parts`` splits the affine offset: a rank decompressing only its own code among ``N``
    passes ``parts=N`` so that the ranks' results sum to the decompression of the summed code.
    """
    plan, pos = model.plan, 0
    slices = np.empty((plan.n_slices, plan.slice_size), dtype=np.float32)
    for g in model.groups:
        width = g.width if g.u is not None else plan.slice_size
        block = code[pos:pos + g.count * width].reshape(g.count, width)
        pos += g.count * width
        slices[g.start:g.start + g.count] = block @ g.u.T if g.u is not None else block
    slices += model.offset / np.float32(parts)
    return slices, code[pos:]


class SampleWindow:
    """One sampling window of a tensor: collects aggregated gradients, trains when full.

    :meth:`add` takes one aggregated gradient's slices (``n_slices x K``); it keeps each
    group's first slice (the PCA samples) and a float64 running sum of all slices (the
    per-slice means), and returns the trained :class:`Model` once ``size`` gradients are in
    (None before).
    """

    def __init__(self, plan: SlicePlan, size: int, loss: float) -> None:
        self.plan = plan
        self.size = size
        self.loss = loss
        self.samples: List[List[np.ndarray]] = [[] for _ in plan.groups]
        self.running = np.zeros((plan.n_slices, plan.slice_size), dtype=np.float64)
        self.count = 0

    def add(self, slices: np.ndarray) -> Optional[Model]:
        slices = np.asarray(slices, dtype=np.float64)
        for i, (start, _count) in enumerate(self.plan.groups):
            self.samples[i].append(slices[start].copy())
        self.running += slices
        self.count += 1
        if self.count < self.size:
            return None
        return train(self.plan, [np.stack(s) for s in self.samples], self.running / self.count, self.loss)


def _require_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"GradiVeQ: {name!r} must be an integer >= {low}, got {value!r}")
    return value


class Settings:
    """The validated parameters of a GradiVeQ compressor, shared by every binding's adapter.

    Args (defaults are the paper's experiment values where it gives them):
        loss: compression-loss threshold ``lambda`` of eq. (6), in (0, 1). Default 0.01.
        reuse: slices sharing one compressor ``s``; 0 means the whole layer (``s = inf``).
        slice_size: ``K``; 0 picks ``3 F D`` / ``F D`` per conv layer (spec Part III.3 item 6).
        max_slice: largest automatic ``K`` (the SVD costs ``O(L_t^2 K)``). Default 4096.
        min_numel: smaller tensors travel uncompressed. Default 1024.
        warmup, sample_iters, compress_iters: the schedule (2500, 100, 400).
        layout: ``"torch"`` (kernels ``(F, D, H, W)``) or ``"tf"`` (``(H, W, D, F)``).
    """

    def __init__(self, loss: float = 0.01, reuse: int = 0, slice_size: int = 0, max_slice: int = 4096,
                 min_numel: int = 1024, warmup: int = 2500, sample_iters: int = 100,
                 compress_iters: int = 400, layout: str = "torch") -> None:
        if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not 0.0 < loss < 1.0:
            raise ConfigError(f"GradiVeQ: 'loss' must be a number in (0, 1), got {loss!r}")
        if layout not in LAYOUTS:
            raise ConfigError(f"GradiVeQ: 'layout' is {layout!r}; allowed: {', '.join(LAYOUTS)}")
        self.loss = float(loss)
        self.reuse = _require_int("reuse", reuse, 0)
        self.slice_size = _require_int("slice_size", slice_size, 0)
        self.max_slice = _require_int("max_slice", max_slice, 2)
        self.min_numel = _require_int("min_numel", min_numel, 0)
        self.layout = layout
        self.schedule = Schedule(_require_int("warmup", warmup, 0), _require_int("sample_iters", sample_iters, 2),
                                 _require_int("compress_iters", compress_iters, 1))

    def get_config(self) -> dict:
        return {"loss": self.loss, "reuse": self.reuse, "slice_size": self.slice_size,
                "max_slice": self.max_slice, "min_numel": self.min_numel, "warmup": self.schedule.warmup,
                "sample_iters": self.schedule.sample_iters, "compress_iters": self.schedule.compress_iters,
                "layout": self.layout}

    def __repr__(self) -> str:
        return "GradiVeQ(" + ", ".join(f"{k}={v!r}" for k, v in self.get_config().items()) + ")"

    def plan(self, shape: Sequence[int]) -> Optional[SlicePlan]:
        """The slicing of a tensor of ``shape`` under these settings (None: uncompressed), refused
        with a ConfigError when its sampling window would hold more than
        :data:`MAX_WINDOW_BYTES` (asked on a tensor's first step, before anything is kept)."""
        plan = slice_plan(shape, self.layout, self.slice_size, self.max_slice, self.min_numel, self.reuse)
        if plan is not None:
            groups = -(-plan.n_slices // plan.group)
            window = window_bytes(plan, self.schedule.sample_iters)
            if window > MAX_WINDOW_BYTES:
                raise ConfigError(
                    f"GradiVeQ: sample_iters={self.schedule.sample_iters} x {groups} groups (reuse={self.reuse}) x "
                    f"slice_size={plan.slice_size} float64 samples would need {size_text(window)} for the sampling "
                    f"window of a tensor of shape {plan.shape}; at most {size_text(MAX_WINDOW_BYTES)} per tensor "
                    "(lower sample_iters, or raise reuse)")
        return plan


@dataclass(frozen=True)
class Schedule:
    """Warm-up, then repeating ``sample_iters`` uncompressed sampling + ``compress_iters``."""

    warmup: int = 2500
    sample_iters: int = 100
    compress_iters: int = 400

    def __post_init__(self):
        if self.warmup < 0 or self.sample_iters < 2 or self.compress_iters < 1:
            raise ConfigError("GradiVeQ: need warmup >= 0, sample_iters >= 2 and compress_iters >= 1; "
                              f"got {self.warmup}, {self.sample_iters}, {self.compress_iters}")

    def phase(self, t: int) -> str:
        """``"warmup"``, ``"sample"`` or ``"compress"`` at iteration ``t`` of a tensor."""
        if t < self.warmup:
            return "warmup"
        u = (t - self.warmup) % (self.sample_iters + self.compress_iters)
        return "sample" if u < self.sample_iters else "compress"

    def last_sample(self, t: int) -> bool:
        """Whether ``t`` closes a sampling window (train right after it)."""
        return t >= self.warmup and (t - self.warmup) % (self.sample_iters + self.compress_iters) == \
            self.sample_iters - 1


def relative_loss(original: np.ndarray, reconstructed: np.ndarray) -> float:
    """``||g_hat - g||^2 / ||g||^2`` (the paper's compression loss)."""
    den = float(np.sum(np.square(original, dtype=np.float64)))
    num = float(np.sum(np.square(np.asarray(reconstructed, np.float64) - original)))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)
