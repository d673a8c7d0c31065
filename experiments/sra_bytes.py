"""Where a rank's received bytes go in the sparse all-reduce: per phase and per part of a container.

``python -m experiments.sra_bytes --config semisync_chunked --ranks 2,4`` reduces the pseudo-gradient
shapes of ``deepreduce reproduce semisync``'s LM (every parameter one tensor, one batch per step, as
``DiLoCo`` sends a fragment) with ``aggregation: sparse_allreduce`` on ranks that are threads of
this process, and parses every container each rank receives: the index and value sections (the
entries), and the bytes that do not depend on the entries (header, codec parameters, the bin-mean
codebook, the container's length in the batch's table). Prints, per number of ranks, the bytes a
rank receives per step (mean over ranks and over the second half of the steps) in each phase,
and the ratio of the last ranks to the first. Gradients are heavy-tailed random (Student t, 3
degrees of freedom): the byte counts of a chunked config depend on the geometry, not the values.
docs/semisync.md, "Received bytes per rank from 2 to 4 workers", quotes it.
"""
from __future__ import annotations

import argparse
import threading
from collections import defaultdict
from typing import Dict, List, Sequence

import numpy as np

import deepreduce
from deepreduce.wire import container, varint

PARTS = ("index", "value", "header", "params", "codebook", "length")
FIXED = ("header", "params", "codebook", "length")


class ThreadGroup:
    """``size`` ranks as threads exchanging through shared slots (a barrier between writing and reading)."""

    def __init__(self, size: int) -> None:
        self.size, self.barrier, self.slots = size, threading.Barrier(size, timeout=120), {}

    def view(self, rank: int):
        group = self

        class View:
            def __init__(self) -> None:
                self.rank, self.size = rank, group.size

            def alltoall(self, payloads, name):
                return group.exchange(rank, list(payloads), lambda sent, j: sent[j][rank])

            def allgather(self, payload, name):
                return group.exchange(rank, payload, lambda sent, j: sent[j])
        return View()

    def exchange(self, rank: int, mine, pick):
        self.slots[rank] = mine
        self.barrier.wait()
        out = [pick(self.slots, j) for j in range(self.size)]
        self.barrier.wait()
        return out


def lm_shapes() -> Dict[str, int]:
    """Element count of every trainable parameter of ``reproduce semisync``'s LM (full budget)."""
    from experiments.lm.model import TransformerLM
    from experiments.reproduce.semisync_methods import FULL

    return {n: p.numel() for n, p in TransformerLM(FULL.model()).named_parameters() if p.requires_grad}


def parts_of(payload, codebook: int = 0) -> Dict[str, int]:
    """The bytes of one received container by part (``codebook``: the bytes of the value section
    that every sparse container carries whatever its entries, e.g. bin-mean's ``2**b`` float32
    means; ``length``: its varint in the batch's table)."""
    c = container.unpack(payload)
    book = codebook if c.n and not c.flags & container.FLAG_DENSE else 0
    pi, pv, li, lv = len(c.index_params), len(c.value_params), len(c.index_section), len(c.value_section)
    return {"index": li, "value": lv - book, "header": len(payload) - pi - pv - li - lv, "params": pi + pv,
            "codebook": book, "length": varint.size(len(payload))}


def codebook_bytes(pipe) -> int:
    """Bytes of a value section that do not depend on its entries: bin-mean's table of means."""
    value = pipe.value
    return 4 * (1 << int(value.bits)) if value.id == "binmean" else 0


def account(config, ranks: int, shapes: Dict[str, int], steps: int = 12, seed: int = 0) -> Dict[str, Dict[str, float]]:
    """``{phase: {part: bytes}}`` a rank receives per step from the other ranks (mean over ranks and
    over the second half of ``steps``), phase ``"1"`` (the shards from every rank) and ``"2"``
    (every owner's reduced shard)."""
    cfg = dict(deepreduce.load_config(config), aggregation={"id": "sparse_allreduce"})
    group = ThreadGroup(ranks)
    pipes = [deepreduce.build(cfg) for _ in range(ranks)]   # built here: the registry fills outside threads
    names = sorted(shapes)
    book = codebook_bytes(pipes[0])
    sent: Dict[tuple, list] = {}
    owned: Dict[tuple, np.ndarray] = {}
    lock, errors = threading.Lock(), []

    def run(rank: int) -> None:
        try:
            rng = np.random.default_rng([seed, rank])
            sra = pipes[rank].aggregation.reducer(pipes[rank], group.view(rank))
            owner_shard = sra._owner_shard

            def record(phase, mine):
                out = owner_shard(phase, mine)
                with lock:
                    owned[(phase.step, rank, phase.name)] = out
                return out
            sra._owner_shard = record
            for step in range(steps):
                phases = []
                for name in names:
                    phase = sra.encode((rng.standard_t(3, shapes[name]) * 1e-3).astype(np.float32), name, step)
                    with lock:
                        sent[(step, rank, name)] = list(phase.sent)
                    phases.append(phase)
                batch = sra.send(phases)
                sra.exchange(batch)
                for index in range(len(phases)):
                    sra.complete(batch, index)
        except BaseException as exc:   # noqa: BLE001 (re-raised in the caller's thread)
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    kept = range(steps // 2, steps)
    out = {"1": defaultdict(float), "2": defaultdict(float)}
    for step in kept:
        for receiver in range(ranks):
            for other in range(ranks):
                if other == receiver:
                    continue
                for name in names:
                    for phase, payload in (("1", sent[(step, other, name)][receiver]), ("2", owned[(step, other, name)])):
                        for part, size in parts_of(payload, book).items():
                            out[phase][part] += size / (ranks * len(kept))
    return {phase: dict(parts) for phase, parts in out.items()}


def table(config, ranks: Sequence[int], steps: int = 12) -> List[str]:
    """The account's lines for every number of ranks, and the last against the first."""
    shapes = lm_shapes()
    params = sum(shapes.values())
    lines = [f"{config} + sparse_allreduce on {len(shapes)} tensors, {params} parameters; bytes a rank receives "
             "per step from the others (mean over ranks)",
             "ranks | phase | " + " | ".join(PARTS) + " | entries | fixed | total"]
    totals = {}
    for n in ranks:
        acc = account(config, n, shapes, steps)
        whole = defaultdict(float)
        for phase in ("1", "2"):
            row = acc[phase]
            for part in PARTS:
                whole[part] += row.get(part, 0.0)
            lines.append(_line(n, phase, row))
        lines.append(_line(n, "both", whole))
        totals[n] = whole
    first, last = ranks[0], ranks[-1]
    for label, keys in (("entries", ("index", "value")), ("fixed", FIXED), ("total", PARTS)):
        a, b = (sum(totals[n].get(k, 0.0) for k in keys) for n in (first, last))
        lines.append(f"{label}: {a:.0f} -> {b:.0f} B ({b / a:.3f}x from {first} to {last} ranks)")
    lines.append("bits per parameter per message: " + ", ".join(
        f"{n} ranks {8 * sum(totals[n].values()) / params:.4f}" for n in ranks))
    return lines


def _line(ranks: int, phase: str, row: Dict[str, float]) -> str:
    entries = row.get("index", 0.0) + row.get("value", 0.0)
    fixed = sum(row.get(k, 0.0) for k in FIXED)
    return (f"{ranks} | {phase} | " + " | ".join(f"{row.get(k, 0.0):.0f}" for k in PARTS)
            + f" | {entries:.0f} | {fixed:.0f} | {entries + fixed:.0f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="semisync_chunked", help="a shipped config's name or a YAML path")
    parser.add_argument("--ranks", default="2,4", help="comma-separated numbers of ranks")
    parser.add_argument("--steps", type=int, default=12, help="steps reduced (the second half is counted)")
    args = parser.parse_args(argv)
    print("\n".join(table(args.config, [int(r) for r in args.ranks.split(",")], args.steps)))


if __name__ == "__main__":
    main()
