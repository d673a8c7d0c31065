"""Gradient buckets: many parameters' gradients compressed as one tensor.

Compressing each parameter's gradient on its own costs a fixed amount per tensor, whatever its
size: the Python glue of the pipeline, a selection, a Bloom filter and a container header of its
own, one collective. A ResNet-20 has 59 gradients, a ResNet-50 161, a BERT about 200: for models
with many small tensors that fixed cost, not the bytes, sets the step time (docs/benchmarks.md,
``deepreduce bench-step --bucket-mb``). A bucket
concatenates the gradients of consecutive parameters, in the order backward produces them (the
reverse of the model's parameter order, as DDP's buckets), up to a byte cap; the pipeline
compresses the concatenation under one name: one selection, one filter, one container and one
allgather per bucket. A tensor left alone in its bucket (one larger than the cap) travels as
without buckets.

What a bucket changes, besides the speed: a sparsifier selects over the whole bucket (Top-r keeps
the ``ratio * bucket size`` largest entries of the bucket: "global" rather than layer-wise Top-r,
so a layer with small gradients sends fewer entries than its share), and error feedback keeps one
residual per bucket, so nothing a layer did not send is lost. Gradients below the pipeline's
``min_numel`` stay out of buckets (Horovod's fused all-reduce sums them, as without buckets).

Where the framework makes the buckets (DDP), :func:`merge` says which of a bucket's tensors are
compressed as one and :func:`bucket_name` / :func:`container_names` name what travels.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..errors import ConfigError

MIB = 1 << 20


def check_bucket_cap(cap_mb, owner: str):
    """``cap_mb`` (None: no buckets, each gradient on its own) if valid, else ConfigError."""
    if cap_mb is None:
        return None
    if isinstance(cap_mb, bool) or not isinstance(cap_mb, (int, float)) or not cap_mb > 0 \
            or cap_mb != cap_mb or cap_mb == float("inf"):
        raise ConfigError(f"{owner}: bucket_cap_mb must be a positive number of MiB or None, got {cap_mb!r}")
    return cap_mb


def check_bucket_cap_for(cap_mb, summable: bool, owner: str):
    """:func:`check_bucket_cap`, and a ConfigError for a cap given with a summable compressor
    (whose all-reduces Horovod's tensor fusion already groups: there is no container to bucket)."""
    cap_mb = check_bucket_cap(cap_mb, owner)
    if cap_mb is not None and summable:
        raise ConfigError(f"{owner}: bucket_cap_mb applies to deepreduce configs; a summable compressor's "
                          "all-reduces are grouped by Horovod's tensor fusion")
    return cap_mb


def refuse_groups(num_groups, groups, owner: str) -> None:
    """A ConfigError for Horovod's ``num_groups``/``groups`` (fixed groups of tensors reduced by one
    grouped allreduce). deepreduce does not take them: grouping tensors into one container changes
    what a sparsifier selects over, so it is asked for explicitly with ``bucket_cap_mb`` (groups of
    consecutive tensors in backward order); the defaults (0, None) pass."""
    if num_groups or groups is not None:
        raise ConfigError(f"{owner}: num_groups/groups (Horovod's grouped allreduce) are not supported: each "
                          "gradient travels as its own container; to send several as one container use "
                          "bucket_cap_mb=<MiB> (consecutive parameters in backward order)")


def plan(sizes: Sequence[int], cap_bytes: float, itemsize: int = 4) -> List[List[int]]:
    """Group tensors of ``sizes`` elements, taken in the given order, into buckets of consecutive
    tensors holding at most ``cap_bytes`` (``itemsize`` bytes an element), filled greedily.
    Returns the buckets of two or more tensors (their positions in ``sizes``, in order). A tensor
    that shares no bucket (one larger than the cap, or one that fits with neither neighbour's
    bucket) travels on its own exactly as without buckets: no copy into and out of a bucket for
    the large tensors, whose per-tensor cost is small beside their size.

    The plan depends on the sizes and the cap only, so ranks with the same model agree on it.
    """
    buckets: List[List[int]] = []
    current: List[int] = []
    used = 0
    for i, size in enumerate(sizes):
        nbytes = int(size) * itemsize
        if current and used + nbytes > cap_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(i)
        used += nbytes
    buckets.append(current)
    return [bucket for bucket in buckets if len(bucket) > 1]


def offsets(sizes: Sequence[int]) -> List[int]:
    """Where each of consecutive tensors of ``sizes`` elements starts in their concatenation."""
    out, at = [], 0
    for size in sizes:
        out.append(at)
        at += int(size)
    return out


def plan_backward(numels: Sequence[Optional[int]], cap_mb: float, min_numel: int = 0) -> List[List[int]]:
    """:func:`plan` of tensors given in the model's order, taken in backward order (the reverse),
    under a cap of ``cap_mb`` MiB: each bucket's positions in ``numels``. A tensor whose size is
    None (not known, or of a dtype that buckets do not take) or below ``min_numel`` stays out."""
    order = [j for j in reversed(range(len(numels))) if numels[j] is not None and numels[j] >= min_numel]
    return [[order[i] for i in members] for members in plan([numels[j] for j in order], cap_mb * MIB)]


def bucket_name(names: Sequence[str], members) -> str:
    """``bucket:<first>..<last>/<count>`` of the tensors at ``members`` (one: its name): the name
    under which tensors compressed as one keep their residual and seeds, and a bucket's row in the
    ``auto`` plan."""
    members = list(members)
    if len(members) == 1:
        return names[members[0]]
    return f"bucket:{names[members[0]]}..{names[members[-1]]}/{len(members)}"


def merge(names: Sequence[str], sizes: Sequence[int], min_numel: int) -> Optional[Tuple[str, List[int]]]:
    """(name, positions) of a bucket's tensors compressed as one container: those of at least
    ``min_numel`` elements (smaller ones travel dense on their own anyway), or None when fewer
    than two are."""
    members = [i for i, size in enumerate(sizes) if int(size) >= min_numel]
    if len(members) < 2:
        return None
    return bucket_name(names, members), members


def container_names(names: Sequence[str], merged: Optional[Tuple[str, List[int]]]) -> List[str]:
    """What each container of a bucket holds, in the order they travel: the merged tensors'
    name (:func:`merge`), then each other tensor's (all of them in order when nothing is merged)."""
    if merged is None:
        return list(names)
    return [merged[0]] + [n for i, n in enumerate(names) if i not in merged[1]]


def describe(names: Sequence[str], shown: int = 4) -> str:
    """The first ``shown`` names quoted, then how many more: a bucket of many tensors in errors."""
    text = ", ".join(repr(n) for n in names[:shown])
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")
