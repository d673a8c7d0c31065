"""``deepreduce fsdp-memory``: compressor memory per rank under FSDP2/HSDP, measured, for every
shipped config (configs/*.yaml).

Four gloo ranks on this machine as a 2x2 (replicate, shard) mesh, the HSDP recipe of
docs/fsdp.md (``fully_shard(..., mesh=mesh["shard"])`` per block, deepreduce on the
reduce-scatter inside a "node" and on the replicate all-reduce between them), train a small
transformer of realistic shape ratios (embedding V x d tied to the output, per block the
attention's qkv d x 3d and projection d x d, the MLP's d x 4d and 4d x d, layer norms) for
``--steps`` steps per config. Per rank and config:

* **persistent**: the bytes of the state arrays the compressor holds after the steps (each
  engine's pipeline residuals and adaptive state, the sparse all-reduce's owner residuals and
  bounds; ``FSDPCompression.state_bytes``, read from the live arrays), and what ``tracemalloc``
  still holds of the allocations made since registration (the same arrays, measured by the
  allocator, plus small Python objects);
* **peak**: ``tracemalloc``'s peak during the steps above what was held before them: the
  compressor's NumPy and Python allocations (containers, decode buffers, selections, copies).
  Torch tensors are not traced (the comm's ``all_to_all`` receive buffers, of the containers'
  size); FSDP's own buffers are not the compressor's.

A discarded warm-up run first keeps one-time imports and caches out of every config's figures.
Both against the rank's fp32 gradient shard (its sharded parameters' elements x 4 bytes). A
config ``register`` refuses is listed with the reason.

    python -m deepreduce fsdp-memory                 # every shipped config (a few minutes on 2 cores)
    python -m deepreduce fsdp-memory --configs fsdp_topk lm_topk --json out.json
"""
from __future__ import annotations

import json
import os
import queue as queue_module
import time
from pathlib import Path
from typing import Dict, List, Sequence

from ..processes import rendezvous_port

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
#: The configs docs/fsdp.md recommends under FSDP: their persistent state must stay within the
#: rank's fp32 gradient shard (tests/test_fsdp_memory.py).
RECOMMENDED = ("fsdp_topk", "fsdp_topk_q8", "lm_topk")
DIM, LAYERS, VOCAB, TOKENS = 128, 4, 4096, 64


def shipped_configs() -> List[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def build_model(torch):
    """A small decoder's shapes: tied embedding, per block qkv, projection, MLP up/down, norms."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
            self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
            self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

        def forward(self, x):
            q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
            attention = torch.softmax(q @ k.transpose(-1, -2) / DIM ** 0.5, dim=-1) @ v
            x = x + self.proj(attention)
            return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.norm = nn.LayerNorm(DIM)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            logits = self.norm(x) @ self.embed.weight.t()
            return torch.nn.functional.cross_entropy(logits[:-1], tokens[1:])

    torch.manual_seed(0)
    return Decoder()


def measure(config: str, rank: int, steps: int) -> dict:
    """One config on this rank (the process group is up and ``tracemalloc`` tracing, see
    :func:`_rank`): persistent and peak bytes, or the reason ``register`` refused it."""
    import gc
    import tracemalloc

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from deepreduce.errors import DeepReduceError
    from deepreduce.torch import fsdp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = build_model(torch)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    shard_bytes = 4 * sum(p.to_local().numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gc.collect()   # what an earlier config left in cycles is freed now, not during this one
    before = tracemalloc.get_traced_memory()[0]
    try:
        try:
            handle = fsdp.register(model, str(CONFIG_DIR / f"{config}.yaml"),
                                   replicate_group=mesh["replicate"].get_group())
        except DeepReduceError as exc:
            return {"config": config, "refused": f"{type(exc).__name__}: {exc}", "shard_bytes": shard_bytes}
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            opt.zero_grad()
            model(torch.randint(0, VOCAB, (TOKENS,), generator=g)).backward()
            opt.step()
        current, peak = tracemalloc.get_traced_memory()
        roles = {role: stats["steps"] for role, stats in handle.stats().items()}
        out = {"config": config, "shard_bytes": shard_bytes, "state_bytes": handle.state_bytes(),
               "traced_persistent": current - before, "traced_peak": peak - held, "steps": roles,
               "by_role": _state_by_role(handle), "bounds_bytes": _bounds_bytes(handle),
               "modules": sum(1 for m in model.modules() if isinstance(m, FSDPModule))}
        handle.close()
        return out
    finally:
        del model, opt


def _state_by_role(handle) -> Dict[str, int]:
    """Persistent state bytes per role (reduce_scatter, replicate)."""
    from deepreduce.torch.fsdp_checkpoint import nbytes

    out: Dict[str, int] = {}
    for (_, role, _), engine in handle._engines.items():
        total = nbytes(engine.core.state_dict())
        if engine.protocol.sparse is not None:
            total += engine.protocol.sparse.state_bytes()
        out[role] = out.get(role, 0) + total
    return out


def _bounds_bytes(handle) -> int:
    """Bytes of the sparse all-reduce's shard bounds (int64, one array per tensor)."""
    from deepreduce.torch.fsdp_checkpoint import nbytes

    return sum(nbytes(e.protocol.sparse.state_dict()["bounds"]) for e in handle._engines.values()
               if e.protocol.sparse is not None)


def _rank(rank: int, world: int, port: int, queue, configs: Sequence[str], steps: int) -> None:
    import tracemalloc
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")   # dense-gradient warnings of sparsifier-free configs
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # Trace from before gloo's threads exist until after they are gone: starting or stopping
    # tracemalloc swaps the raw allocator's hooks, and a gloo thread allocating meanwhile crashed
    # a rank with SIGSEGV in libpython now and then (1 run in 2-4 when each config started and
    # stopped it; none in 6 runs without tracing).
    tracemalloc.start()
    rows = []
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        measure("fsdp_topk", rank, 1)   # a warm-up, discarded: one-time imports and caches are not a config's
        for config in configs:
            rows.append(dict(measure(config, rank, steps), rank=rank))
    except BaseException as exc:   # the parent names it and stops the other ranks at once
        queue.put((rank, f"{type(exc).__name__}: {exc}"))
        raise
    else:
        queue.put((rank, rows))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(configs: Sequence[str], steps: int = 2, timeout: float = 900.0) -> List[dict]:
    """Every rank's rows for ``configs`` (4 spawned gloo ranks)."""
    import torch.multiprocessing as mp

    port = rendezvous_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(rank, 4, port, queue, list(configs), steps)) for rank in range(4)]
    for p in procs:
        p.start()
    rows: List[dict] = []
    reported: set = set()
    deadline = time.monotonic() + timeout
    try:
        while len(reported) < len(procs):   # a rank that dies before reporting fails the run now, not at the deadline
            try:
                rank, mine = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"fsdp-memory: rank(s) {dead} exited with "
                                       f"{[procs[r].exitcode for r in dead]} before reporting" if dead else
                                       f"fsdp-memory: ranks {sorted(set(range(len(procs))) - reported)} did not "
                                       f"report within {timeout:g} s") from None
                continue
            if isinstance(mine, str):
                raise RuntimeError(f"fsdp-memory: rank {rank} failed: {mine}")
            reported.add(rank)
            rows.extend(mine)
    finally:
        for p in procs:
            p.join(30 if len(reported) == len(procs) else 2)
            if p.is_alive():
                p.kill()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"fsdp-memory: ranks exited with {[p.exitcode for p in procs]}")
    return rows


def table(rows: List[dict]) -> str:
    """Markdown: one line per config, the largest figure over the ranks."""
    lines = ["| config | reduce-scatter state | replicate state | persistent (traced) | x fp32 grad shard | "
             "peak transient (traced) |", "|---|---:|---:|---:|---:|---:|"]
    for config in sorted({r["config"] for r in rows}):
        mine = [r for r in rows if r["config"] == config]
        if "refused" in mine[0]:
            lines.append(f"| `{config}` | refused: {mine[0]['refused'].split(': ', 1)[1][:90]} | | | | |")
            continue
        worst = max(mine, key=lambda r: r["state_bytes"])
        role = {k: max(r["by_role"].get(k, 0) for r in mine) for k in ("reduce_scatter", "replicate")}
        lines.append(f"| `{config}` | {role['reduce_scatter']:,} | {role['replicate']:,} | "
                     f"{worst['state_bytes']:,} ({max(r['traced_persistent'] for r in mine):,}) | "
                     f"{worst['state_bytes'] / worst['shard_bytes']:.2f} | "
                     f"{max(r['traced_peak'] for r in mine):,} |")
    shard = rows[0]["shard_bytes"]
    lines.append(f"\nfp32 gradient shard per rank: {shard:,} bytes (model {2 * shard // 4:,} parameters over a "
                 "shard group of 2)")
    return "\n".join(lines)


def register(subparsers) -> None:
    p = subparsers.add_parser("fsdp-memory", help="compressor memory per rank under FSDP/HSDP, measured per config")
    p.add_argument("--configs", nargs="+", default=None, help="config names (default: every configs/*.yaml)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--json", default=None, help="also write every rank's rows here")
    p.set_defaults(func=_main)


def _main(args) -> int:
    configs = args.configs or shipped_configs()
    unknown = sorted(set(configs) - set(shipped_configs()))
    if unknown:
        raise SystemExit(f"fsdp-memory: unknown config(s) {unknown}; shipped: {shipped_configs()}")
    rows = run(configs, steps=args.steps)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0
