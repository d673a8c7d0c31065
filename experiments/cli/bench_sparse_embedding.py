"""``deepreduce bench-sparse-embedding``: an embedding table's sparse gradient, three ways.

A table of ``--rows`` x ``--dim`` float32 (default 10^6 x 64, 256 MB) and ``--ranks`` ranks, each
looking up ``--lookups`` ids drawn from a Zipf law (``--zipf``; recommender traffic: a few hot
ids, a long tail), gives each rank a sparse COO gradient. For every rank the command reports the
bytes it sends and receives and the CPU time of its local work, for

- deepreduce: the gradient's touched entries through a config
  (:func:`deepreduce.collective.routes.entries.encode_entries`; the code path of the optimizer and the
  DDP hook: ``deepreduce.torch.sparse.entries``, encode, then decode-sum of every rank's
  container and the COO result);
- Horovod's sparse allgather (``sparse_allreduce_async``): every rank's uncoalesced indices
  (int64) and rows travel; the receiver concatenates and the optimizer coalesces;
- a dense all-reduce (``sparse_as_dense=True``): a ring moves 2 (N-1)/N of the dense table per rank;
  local work is the densification and the sum.

No network is involved: bytes are what each scheme puts on the wire, times are the local work
(one process plays every rank), so the comparison holds on any link speed; add bytes / bandwidth.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from deepreduce.collective.routes.entries import decode_entries, encode_entries
from deepreduce.config import build

DEFAULT_CONFIGS = ("none_raw", "sparse_delta", "sparse_topk_delta")
INLINE_CONFIGS = {   # the lossless entries with a delta index, and Top-r among the touched entries
    "sparse_delta": {"sparsifier": "none", "index": "delta", "value": "raw", "memory": "none"},
    "sparse_topk_delta": {"sparsifier": {"id": "topk", "ratio": 0.25}, "index": "delta", "value": "raw",
                          "memory": "none"},
}


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench-sparse-embedding", help="an embedding table's sparse gradient: deepreduce "
                                   "entries vs Horovod's sparse allgather vs a dense all-reduce (bytes, local time)")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--lookups", type=int, default=8192, help="ids looked up per rank and step")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the ids")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    parser.add_argument("--repeat", type=int, default=3, help="timed runs (median)")
    parser.set_defaults(func=run)


def gradients(args) -> list:
    """Each rank's uncoalesced COO gradient of ``sum(embedding(ids))`` (as nn.Embedding(sparse=True) makes)."""
    out = []
    for rank in range(args.ranks):
        rng = np.random.default_rng(rank)
        ids = (rng.zipf(args.zipf, args.lookups) - 1) % args.rows
        values = torch.from_numpy(rng.standard_normal((args.lookups, args.dim)).astype(np.float32))
        out.append(torch.sparse_coo_tensor(torch.from_numpy(ids)[None], values, (args.rows, args.dim),
                                           check_invariants=False))
    return out


def median_seconds(fn, repeat: int):
    times, result = [], None
    for _ in range(repeat):
        start = time.process_time()
        result = fn()
        times.append(time.process_time() - start)
    return float(np.median(times)), result


def deepreduce_row(name: str, grads, args) -> dict:
    from deepreduce.torch.sparse import entries, from_entries

    pipe = build(INLINE_CONFIGS.get(name, name))
    shape = (args.rows, args.dim)

    def encode_all():
        return [encode_entries(pipe, *entries(g), shape, name="emb", step=0) for g in grads]

    encode_s, payloads = median_seconds(encode_all, args.repeat)
    decode_s, _ = median_seconds(lambda: from_entries(*decode_entries(pipe, payloads, shape), like=grads[0]),
                                 args.repeat)
    sent = float(np.mean([p.shape[0] for p in payloads]))
    return {"scheme": f"deepreduce {name}", "sent": sent, "received": sent * (args.ranks - 1),
            "local_s": encode_s / args.ranks + decode_s}


def horovod_rows(grads, args) -> list:
    n = args.ranks
    sent = float(np.mean([g._nnz() * (8 + 4 * args.dim) for g in grads]))

    def gather_and_coalesce():
        indices = torch.cat([g._indices() for g in grads], dim=1)
        values = torch.cat([g._values() for g in grads]) / n
        return torch.sparse_coo_tensor(indices, values, grads[0].shape, check_invariants=False).coalesce()

    sparse_s, _ = median_seconds(gather_and_coalesce, args.repeat)
    dense_s, _ = median_seconds(lambda: sum(g.to_dense() for g in grads) / n, args.repeat)
    ring = 2 * (n - 1) / n * 4 * args.rows * args.dim
    return [{"scheme": "horovod sparse allgather", "sent": sent, "received": sent * (n - 1), "local_s": sparse_s},
            {"scheme": "dense all-reduce (ring)", "sent": ring, "received": ring, "local_s": dense_s / n}]   # every rank densifies, the ring sums


def run(args) -> None:
    grads = gradients(args)
    touched = [int(g.coalesce()._nnz()) for g in grads]
    print(f"embedding {args.rows} x {args.dim} float32 ({4 * args.rows * args.dim / 2**20:.0f} MiB), {args.ranks} ranks, "
          f"{args.lookups} Zipf({args.zipf}) lookups per rank: {touched} distinct rows touched")
    rows = [deepreduce_row(name, grads, args) for name in args.configs.split(",")] + horovod_rows(grads, args)
    print(f"{'scheme':34s} {'sent/rank':>12s} {'received/rank':>14s} {'local CPU s/rank':>17s}")
    for r in rows:
        print(f"{r['scheme']:34s} {r['sent'] / 2**10:10.1f} K {r['received'] / 2**10:12.1f} K {r['local_s']:17.4f}")
