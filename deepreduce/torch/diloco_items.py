"""How a DiLoCo fragment's pseudo-gradient travels: the step engine's items for one reduction.

Three layouts, chosen once per DiLoCo (every worker alike: the agreement compares it):

* ``bundled`` (over torch.distributed): one item whose parts are the fragment's parameters, one
  container per parameter, all in one collective;
* ``per_parameter`` (over Horovod, which splits a gathered buffer by container headers): one item
  per parameter;
* ``flat`` (``DiLoCo(flat=True)``, either backend): the fragment's flat Δ as one tensor, one
  container per shard and phase. The fewest header bytes, which is what keeps the sparse
  all-reduce's received bytes at 2(N-1)/N of a message on a model of many small tensors; the
  sparsifier then selects over the fragment as one vector (a chunked one's chunks run across
  parameter boundaries) and the error-feedback residual is kept per fragment.
"""
from __future__ import annotations

from typing import List

from ..collective.routes.dense import summed_dense
from ..collective.step import Item


def fragment_items(layout: str, fragment: int, round_: int, delta, parts, core) -> List[Item]:
    """The items of fragment ``fragment``'s reduction ``round_``: ``delta`` is its flat Δ and
    ``parts`` (name, parameter, global copy, Δ view) its parameters'. A tensor below the config's
    ``min_numel`` travels dense anyway: a fragment whose every part does is one float32 all-reduce,
    DiLoCo's uncompressed pseudo-gradient."""
    label = f"fragment {fragment} (outer round {round_})"
    if layout == "flat":
        return [Item(f"fragment.{fragment}", round_, delta, label=label, summed_dense=summed_dense(core, delta.numel()))]
    if layout == "bundled":
        dense = all(summed_dense(core, view.numel()) for _, _, _, view in parts)
        return [Item(f"fragment.{fragment}", round_, delta, label=label, summed_dense=dense,
                     parts=[(name, view) for name, _, _, view in parts])]
    return [Item(name, round_, view, label=f"parameter {name!r} (outer round {round_})") for name, _, _, view in parts]
