"""How a config's containers are aggregated across ranks: the ``aggregation`` config section.

``allgather`` (the default, DeepReduce's scheme): every rank receives every rank's container
and decodes all of them; per-rank receive volume and decode work grow with the number of ranks.
``sparse_allreduce`` (:mod:`deepreduce.collective.sparse_allreduce`): an alltoall of index-space
shards, the owner re-selects, an allgather returns the shards; per-rank volume does not grow
with the ranks. ``auto`` (:mod:`deepreduce.collective.auto`): a planner picks, per tensor or bucket,
dense or fp16 all-reduce, the allgather or the sparse all-reduce, from measured costs, the link
and the backward timeline. The section changes no container byte (it is not part of the wire digest), but
ranks must agree on it: it is part of the compressor identity every rank compares before the
first collective (:func:`deepreduce.collective.agreement.compressor_identity`).
"""
from __future__ import annotations

from ..params import Component, Param
from ..registry import register
from .sparse_allreduce import EARLY_NUMEL, RESELECT, SparseAllreduce


class Aggregation(Component):
    """Base of the aggregation strategies (config section ``aggregation``)."""

    kind = "aggregation"

    def reducer(self, pipeline, communicator):
        """The object that reduces one tensor at a time over ``communicator``; None: allgather."""
        return None

    def planner(self, pipeline, communicator):
        """The run-time planner choosing each tensor's aggregation; None: one aggregation for all."""
        return None


@register
class Allgather(Aggregation):
    """Every rank's container reaches every rank (the default)."""

    id = "allgather"


@register
class SparseAllreduceAggregation(Aggregation):
    """Shards by alltoall, owner re-selection with an owner-side residual, shards by allgather."""

    id = "sparse_allreduce"
    PARAMS = {
        "reselect": Param(str, default="topk", choices=RESELECT,
                          doc="owner's re-selection: the shard's top 'ratio' (topk) or every non-zero (none)"),
        "repartition_every": Param(int, default=8, low=1, high=2**31,
                                   doc="steps between moves of the shard boundaries"),
        "early_numel": Param(int, default=EARLY_NUMEL, low=0, high=2**62,
                             doc="a tensor or bucket of at least this many elements starts its shard exchange "
                                 "as soon as it is encoded, during backward; smaller ones share one exchange "
                                 "after backward (0: every one early; 2**62: none)"),
    }

    def reducer(self, pipeline, communicator) -> SparseAllreduce:
        return SparseAllreduce(pipeline, communicator, reselect=self.reselect,
                               repartition_every=self.repartition_every, early_numel=self.early_numel)


@register
class AutoAggregation(SparseAllreduceAggregation):
    """Per tensor or bucket, the aggregation the planner predicts fastest (see
    :mod:`deepreduce.collective.auto`); ``reselect`` and ``repartition_every`` apply where it picks the
    sparse all-reduce."""

    id = "auto"
    PARAMS = {
        **SparseAllreduceAggregation.PARAMS,
        "bandwidth_gbit": Param(float, default=0.0, low=0.0, high=1e6,
                                doc="link bandwidth in Gbit/s; 0: measured by a probe at the first plan"),
        "latency_us": Param(float, default=25.0, low=0.0, high=1e7, doc="latency of one message (with bandwidth_gbit)"),
        "replan_every": Param(int, default=500, low=0, high=2**31,
                              doc="steps between re-measurements (0: plan once, after the first step)"),
        "drift": Param(float, default=0.25, low=0.0, high=1e6, low_open=True,
                       doc="relative change of a predicted time that triggers a new plan"),
        "host_costs": Param(bool, default=True,
                            doc="count the rank's host CPU (passes, hand-over, each collective call and "
                                "received byte), probed at each plan; false: codec and link only"),
    }

    def planner(self, pipeline, communicator):
        from .auto import AutoPlanner

        return AutoPlanner(self, pipeline, communicator)
