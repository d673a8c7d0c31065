"""HSDP's gradient reduction on N nodes x G accelerators, modelled (``bench-scaling --hsdp``).

HSDP shards a model over the G accelerators of a node (FSDP's reduce-scatter over NVLink-class
links) and replicates it across N nodes: every rank then all-reduces its 1/G shard of the
gradient with the ranks holding the same shard on the other nodes, over the inter-node link.
That all-reduce is where deepreduce goes (docs/fsdp.md, ``register(..., replicate_group=...)``).
Per FSDP module (one per transformer block, plus the embedding and output layers), per rank:

* intra-node, both rows: FSDP's own bf16 ring reduce-scatter over G ranks,
  ``(G-1) alpha_nv + (G-1)/G * 2 P_module / bw_nv``;
* ``hsdp-bf16``: ring all-reduce of the bf16 shard (``P_module / G`` elements, 2 bytes each) over
  N ranks, ``2(N-1) alpha + 2(N-1)/N * bytes / bw`` (:func:`~deepreduce.collective.cost_model.ring_allreduce_s`);
* ``deepreduce``: the sparse all-reduce of the shard over N ranks with the config's measured
  container sizes and codec seconds (:func:`~deepreduce.collective.cost_model.sparse_allreduce_cost`).

Assumptions, stated: one NIC of the given bandwidth per accelerator (as on 8 x 400 Gbit/s
nodes); the inter-node collectives of the G ranks of a node run in parallel on their own NICs;
nothing overlaps (the figures are the reduction's seconds per step, not a step time); codec
seconds are the CPU costs measured on this machine (``--costs``), not an accelerator's.
Transformer shapes: LLaMA-2 7B (d 4096, 32 layers, MLP 11008, vocabulary 32000) and 70B (d 8192,
80 layers, MLP 28672, 8 key/value heads of 128, vocabulary 32000).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

from deepreduce.collective.cost_model import CodecCosts, Link, ring_allreduce_s, sparse_allreduce_cost

BF16_BYTES = 2
DEFAULT_NODES = tuple(2 ** i for i in range(1, 10))   # 2 ... 512
DEFAULT_GBITS = (25.0, 100.0, 400.0)
NVLINK_GBYTE = 450.0   # bytes per second per direction per accelerator, in GB/s (H100 NVLink class)
NVLINK_ALPHA_S = 5e-6


@dataclass(frozen=True)
class Transformer:
    title: str
    dim: int
    layers: int
    mlp: int
    vocab: int
    kv_dim: int   # the key/value projections' width (dim without grouped-query attention)

    def modules(self) -> List[int]:
        """Parameters per FSDP module: the embedding, each block (attention and gated MLP, two
        norms), the final norm with the output layer."""
        block = 2 * self.dim * self.dim + 2 * self.dim * self.kv_dim + 3 * self.dim * self.mlp + 2 * self.dim
        return [self.vocab * self.dim] + [block] * self.layers + [self.vocab * self.dim + self.dim]

    def parameters(self) -> int:
        return sum(self.modules())


MODELS: Dict[str, Transformer] = {
    "7b": Transformer("7B transformer (LLaMA-2 7B shapes)", 4096, 32, 11008, 32000, 4096),
    "70b": Transformer("70B transformer (LLaMA-2 70B shapes)", 8192, 80, 28672, 32000, 1024),
}


@dataclass(frozen=True)
class Row:
    """One (model, nodes, link) point: per rank per step, the inter-node bytes sent and seconds
    of each way, the intra-node reduce-scatter's seconds, deepreduce's codec seconds."""

    model: str
    nodes: int
    gbit: float
    intra_s: float
    bf16_bytes: float
    bf16_s: float
    deepreduce_bytes: float
    deepreduce_comm_s: float
    deepreduce_codec_s: float

    @property
    def bytes_ratio(self) -> float:
        return self.deepreduce_bytes / self.bf16_bytes

    @property
    def comm_speedup(self) -> float:
        return self.bf16_s / self.deepreduce_comm_s


def rows(model: str, nodes: Sequence[int], gbits: Sequence[float], codec: CodecCosts, per_node: int = 8,
         alpha_s: float = 25e-6) -> List[Row]:
    """The model's rows for every node count and inter-node bandwidth."""
    spec = MODELS[model]
    nv = Link(NVLINK_ALPHA_S, NVLINK_GBYTE * 1e9)
    modules = spec.modules()
    intra = sum(nv.seconds(per_node - 1, (per_node - 1) / per_node * BF16_BYTES * m) for m in modules)
    out = []
    for gbit in gbits:
        link = Link.from_gbit(gbit, alpha_s)
        for n in nodes:
            shards = [m / per_node for m in modules]
            bf16_s = sum(ring_allreduce_s(link, n, BF16_BYTES * s) for s in shards)
            bf16_bytes = sum(2 * (n - 1) / n * BF16_BYTES * s for s in shards)
            costs = [sparse_allreduce_cost(link, n, s, codec) for s in shards]
            out.append(Row(model, n, gbit, intra, bf16_bytes, bf16_s, sum(c.sent_bytes for c in costs),
                           sum(c.comm_s for c in costs), sum(c.encode_s + c.decode_s for c in costs)))
    return out


def table(model: str, gbit: float, found: Sequence[Row], codec: CodecCosts, per_node: int = 8) -> str:
    """One model and bandwidth: a line per node count."""
    spec = MODELS[model]
    lines = [f"HSDP, {spec.title}: {spec.parameters():,} parameters, {len(spec.modules())} FSDP modules; N nodes x "
             f"{per_node}, {gbit:g} Gbit/s per accelerator between nodes, NVLink {NVLINK_GBYTE:g} GB/s inside; "
             f"deepreduce = sparse all-reduce of {codec.name} (ratio {codec.ratio:g}) on the replicate dimension",
             f"{'N':>5} {'intra s':>8} {'bf16 MB/rank':>13} {'bf16 s':>8} {'dr MB/rank':>11} {'dr/bf16':>8} "
             f"{'dr comm s':>10} {'speedup':>8} {'dr codec s*':>12}"]
    for r in (r for r in found if r.model == model and r.gbit == gbit):
        lines.append(f"{r.nodes:>5} {r.intra_s:>8.3f} {r.bf16_bytes / 1e6:>13.1f} {r.bf16_s:>8.3f} "
                     f"{r.deepreduce_bytes / 1e6:>11.1f} {r.bytes_ratio:>8.3f} {r.deepreduce_comm_s:>10.3f} "
                     f"{r.comm_speedup:>7.1f}x {r.deepreduce_codec_s:>12.2f}")
    lines.append("  * codec seconds: this machine's CPU costs (--costs), one rank, not an accelerator's")
    return "\n".join(lines)
