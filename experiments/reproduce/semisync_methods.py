"""The rows of ``deepreduce reproduce semisync``: methods, the model and the training budgets.

A method is a JSON-able dict that travels to the ranks:

* ``{"kind": "ddp", "hook": "allreduce" | "fp16"}``: PyTorch's DDP communication hook
  (:mod:`experiments.reproduce.torch_hooks`), every step. The half-precision row is fp16:
  PyTorch's ``bf16_compress_hook`` refuses a CPU model ("requires CUDA 11+ and NCCL 2.10+"), so
  on gloo CPU ``fp16_compress_hook`` stands for it (the same 16 bits per value on the wire);
* ``{"kind": "ddp", "config": NAME}``: deepreduce's DDP hook with the shipped config ``NAME``,
  every step;
* ``{"kind": "diloco", "sync_every": H, "compression": NAME | dict | None, "outer": "nesterov" |
  "average", "aggregation": None | "sparse_allreduce", "fragments": P, "delay": d}``:
  :class:`deepreduce.torch.DiLoCo` around the same AdamW inner loop; ``compression`` is a shipped
  config's name (``configs/NAME.yaml``) or a config written here (:data:`FP32`: one float32
  all-reduce per outer step; :data:`INT8`; :func:`chunked`); ``outer`` is DiLoCo's Nesterov SGD
  (lr 0.7, momentum 0.9; ALGORITHMS.md IV.1) or SparseLoCo's plain averaging (SGD, lr 1, no
  momentum; IV.4), the latter for the recipes whose error-feedback accumulator replaces outer
  momentum, or a dict of SGD settings of the row's own (:func:`outer_sgd`).

:data:`METHODS` are the table's rows (a default run trains them all); :data:`SWEEP` holds the rows
of the sweep toward the issue's loss-and-bits target (docs/semisync.md, "Quality at this budget"),
trained only when ``--methods`` names them.

The int8 rows use deepreduce's QSGD value codec at 127 levels (int8 codes) with one float32 norm
per 64 values, every entry sent, no error feedback (INTELLECT-1's int8 pseudo-gradient, IV.5, has
none): 8.5 bits per value. It is QSGD's stochastic L2-normalised rounding, not a per-tensor absmax
int8 quantiser (no such codec ships), so its noise is that of ``lm_qsgd`` without the residual.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence

# The uncompressed pseudo-gradient: every tensor below min_numel, so DiLoCo sums each fragment by
# one float32 all-reduce (DiLoCo's own baseline), not as lossless containers by allgather.
FP32 = {"sparsifier": {"id": "none"}, "index": {"id": "raw"}, "value": {"id": "raw"}, "memory": {"id": "none"},
        "min_numel": 2 ** 60, "nonfinite": "propagate"}
# 8-bit pseudo-gradients with an existing deepreduce codec (see the module docstring).
INT8 = {"sparsifier": {"id": "topk", "ratio": 1.0}, "index": {"id": "rle"},
        "value": {"id": "qsgd", "levels": 127, "bucket_size": 64}, "memory": {"id": "none"}}


def _diloco(h: int, compression, outer="nesterov", aggregation: Optional[str] = None,
            fragments: int = 1, delay: int = 0, flat: bool = False) -> dict:
    """A DiLoCo row; ``flat``: each fragment travels as one tensor (``DiLoCo(flat=True)``; the key
    is written only then, so the other rows' cached runs keep their names)."""
    method = {"kind": "diloco", "sync_every": h, "compression": compression, "outer": outer,
              "aggregation": aggregation, "fragments": fragments, "delay": delay}
    if flat:
        method["flat"] = True
    return method


METHODS: Dict[str, dict] = {
    "ddp_fp32": {"kind": "ddp", "hook": "allreduce"},
    "ddp_fp16": {"kind": "ddp", "hook": "fp16"},
    "lm_topk": {"kind": "ddp", "config": "lm_topk"},
    "diloco_h10_fp32": _diloco(10, FP32),
    "diloco_h30_fp32": _diloco(30, FP32),
    "diloco_h100_fp32": _diloco(100, FP32),
    "diloco_h10_int8": _diloco(10, INT8),
    "diloco_h30_int8": _diloco(30, INT8),
    "diloco_h100_int8": _diloco(100, INT8),
    "demo_style_h30": _diloco(30, "demo_style", outer="average"),
    "sparseloco_h30": _diloco(30, "sparseloco", outer="average"),
    "semisync_h30": _diloco(30, "semisync_topk", outer="average"),
    "semisync_h30_sra": _diloco(30, "semisync_topk", outer="average", aggregation="sparse_allreduce"),
    # the same compressor at DiLoCo's best period here, with outer momentum, and denser
    "semisync_h100": _diloco(100, "semisync_topk", outer="average"),
    "semisync_h30_nesterov": _diloco(30, "semisync_topk"),
    "semisync_dense_h30": _diloco(30, "semisync_dense", outer="average"),
    # the sweep's best (docs/semisync.md): finer chunks, synchronised every 10 steps
    "semisync_chunked_h10": _diloco(10, "semisync_chunked", outer="average"),
    "semisync_chunked_h10_sra": _diloco(10, "semisync_chunked", outer="average", aggregation="sparse_allreduce"),
    # the second sweep's best: 1-bit values, every tensor chunked, synchronised every 5 steps,
    # the averaged pseudo-gradient applied at outer lr 1.2
    "semisync_1bit_h5": _diloco(5, "semisync_1bit", outer={"lr": 1.2}),
    # through the sparse all-reduce, per parameter and with each fragment as one flat tensor (one
    # container per shard and phase: the received bytes' fixed part no longer grows with the workers)
    "semisync_chunked_h10_flat_sra": _diloco(10, "semisync_chunked", outer="average", aggregation="sparse_allreduce",
                                             flat=True),
    "semisync_1bit_h5_sra": _diloco(5, "semisync_1bit", outer={"lr": 1.2}, aggregation="sparse_allreduce"),
    "semisync_1bit_h5_flat_sra": _diloco(5, "semisync_1bit", outer={"lr": 1.2}, aggregation="sparse_allreduce",
                                         flat=True),
}


def chunked(chunk: int, k: int, bits: int, decay: float = 0.95, min_numel: Optional[int] = None) -> dict:
    """A semi-synchronous config written here: chunked Top-``k`` of ``chunk`` with decayed error
    feedback, ``chunk_enum`` indices and ``bits``-bit bin-mean values (the sweep's rows; a shipped
    config of the same parameters resolves to the same dict, so its cached runs carry over).
    ``min_numel``: the config's own (None: the default, 1,000 elements: smaller tensors, the
    LayerNorm weights and biases, travel dense; 0: every tensor is chunked, a tensor smaller than
    the chunk being one tail chunk of ``ceil(k d / C)`` entries)."""
    config = {"sparsifier": {"id": "chunk_topk", "chunk": chunk, "k": k},
              "index": {"id": "chunk_enum", "chunk": chunk},
              "value": {"id": "binmean", "bits": bits}, "memory": {"id": "decayed_residual", "decay": decay}}
    if min_numel is not None:
        config["min_numel"] = min_numel
    return config


# Nesterov outer SGD at a mild momentum: its lookahead extrapolates the averaged step (DiLoCo's
# momentum 0.9 at lr 0.7 overshoots on this budget, docs/benchmarks.md).
NESTEROV_05 = {"lr": 1.0, "momentum": 0.5, "nesterov": True}

# The sweep toward the target (docs/semisync.md, "Quality at this budget: the sweep"):
# rows that ``--methods`` may name but that a default run leaves out. Names: period H, chunk (c1k:
# 1,024; c4k: 4,096) and k per chunk, value bits, then what differs from decay 0.95 and averaging.
SWEEP: Dict[str, dict] = {
    # the loss of semi-synchrony itself: the uncompressed pseudo-gradient, plainly averaged
    "diloco_h30_fp32_avg": _diloco(30, FP32, outer="average"),
    "diloco_h10_fp32_avg": _diloco(10, FP32, outer="average"),
    "diloco_h5_fp32_avg": _diloco(5, FP32, outer="average"),
    "diloco_h5_fp32_lr18": _diloco(5, FP32, outer={"lr": 1.8}),   # the outer lr the 4-worker 1-bit rows liked
    "diloco_h2_fp32_avg": _diloco(2, FP32, outer="average"),
    "sweep_h30_c4k_k256_b2_d1": _diloco(30, chunked(4096, 256, 2, decay=1.0), outer="average"),
    "sweep_h30_c1k_k128_b2": _diloco(30, chunked(1024, 128, 2), outer="average"),
    "sweep_h30_c1k_k128_b2_d09": _diloco(30, chunked(1024, 128, 2, decay=0.9), outer="average"),
    "sweep_h30_c1k_k128_b2_n05": _diloco(30, chunked(1024, 128, 2), outer=NESTEROV_05),
    "sweep_h30_c1k_k128_b2_lr15": _diloco(30, chunked(1024, 128, 2), outer={"lr": 1.5}),
    "sweep_h30_c1k_k256_b2": _diloco(30, chunked(1024, 256, 2), outer="average"),
    "sweep_h30_c1k_k256_b2_lr15": _diloco(30, chunked(1024, 256, 2), outer={"lr": 1.5}),
    "sweep_h30_c1k_k256_b2_lr2": _diloco(30, chunked(1024, 256, 2), outer={"lr": 2.0}),
    "sweep_h20_c1k_k128_b2": _diloco(20, chunked(1024, 128, 2), outer="average"),
    "sweep_h15_c1k_k64_b2": _diloco(15, chunked(1024, 64, 2), outer="average"),
    "sweep_h10_c1k_k48_b2": _diloco(10, chunked(1024, 48, 2), outer="average"),
    "sweep_h10_c1k_k48_b2_d098": _diloco(10, chunked(1024, 48, 2, decay=0.98), outer="average"),
    # Streaming DiLoCo of the best row: 2 fragments synced 5 steps apart, each applied 1 step late
    "sweep_h10_c1k_k48_b2_stream": _diloco(10, chunked(1024, 48, 2), outer="average", fragments=2, delay=1),
    # ... and of the H = 30 row, where the step a fragment trains during its delay is 1 of 30
    "sweep_h30_c1k_k256_b2_stream": _diloco(30, chunked(1024, 256, 2), outer="average", fragments=2, delay=1),
    # the second sweep: a smaller H at the same bits (0.048-0.050), fewer entries per chunk. Suffix
    # m0: min_numel 0, the 1,792 LayerNorm and bias elements chunked too (a 64-element tensor is
    # one tail chunk of ceil(k 64 / 1024) entries) instead of sent dense (0.09 bits per parameter
    # per message, 0.018 per inner step at H = 5), their bits spent on more entries of every chunk
    "sweep_h5_c1k_k16_b2": _diloco(5, chunked(1024, 16, 2), outer="average"),
    "sweep_h5_c1k_k26_b2_m0": _diloco(5, chunked(1024, 26, 2, min_numel=0), outer="average"),
    "sweep_h6_c1k_k34_b2_m0": _diloco(6, chunked(1024, 34, 2, min_numel=0), outer="average"),
    # 900 is no multiple of 7: the last evaluation (step 900) reads each worker's local model, 4
    # inner steps after the last outer step, not the global parameters
    "sweep_h7_c1k_k28_b2": _diloco(7, chunked(1024, 28, 2), outer="average"),
    "sweep_h10_c1k_k66_b2_m0": _diloco(10, chunked(1024, 66, 2, min_numel=0), outer="average"),
    # 1-bit bin-mean values: two means per message, the bits go to more entries
    "sweep_h5_c1k_k18_b1": _diloco(5, chunked(1024, 18, 1), outer="average"),
    "sweep_h5_c1k_k32_b1_m0": _diloco(5, chunked(1024, 32, 1, min_numel=0), outer="average"),
    "sweep_h5_c1k_k32_b1_m0_d0975": _diloco(5, chunked(1024, 32, 1, decay=0.975, min_numel=0), outer="average"),
    "sweep_h6_c1k_k40_b1_m0": _diloco(6, chunked(1024, 40, 1, min_numel=0), outer="average"),
    "sweep_h10_c1k_k64_b1": _diloco(10, chunked(1024, 64, 1), outer="average"),
    "sweep_h10_c1k_k82_b1_m0": _diloco(10, chunked(1024, 82, 1, min_numel=0), outer="average"),
    # an outer lr a little above 1 at a small H: each worker's AdamW steps on half DDP's batch are
    # shorter in noisy directions, and the average of two such steps shorter still
    "sweep_h5_c1k_k26_b2_m0_lr12": _diloco(5, chunked(1024, 26, 2, min_numel=0), outer={"lr": 1.2}),
    "sweep_h10_c1k_k48_b2_lr12": _diloco(10, chunked(1024, 48, 2), outer={"lr": 1.2}),
    "sweep_h5_c1k_k32_b1_m0_lr12": _diloco(5, chunked(1024, 32, 1, min_numel=0), outer={"lr": 1.2}),
    "sweep_h5_c1k_k32_b1_m0_d0975_lr12": _diloco(5, chunked(1024, 32, 1, decay=0.975, min_numel=0),
                                                 outer={"lr": 1.2}),
    "sweep_h5_c1k_k32_b1_m0_lr14": _diloco(5, chunked(1024, 32, 1, min_numel=0), outer={"lr": 1.4}),
    "sweep_h6_c1k_k40_b1_m0_lr12": _diloco(6, chunked(1024, 40, 1, min_numel=0), outer={"lr": 1.2}),
    # 4 workers: a coordinate only one worker selected arrives divided by N in the average, so
    # the outer step on sparse pseudo-gradients shrinks as N grows; a larger outer lr makes up for it
    "sweep_h5_c1k_k32_b1_m0_lr18": _diloco(5, chunked(1024, 32, 1, min_numel=0), outer={"lr": 1.8}),
    "sweep_h5_c1k_k32_b1_m0_lr24": _diloco(5, chunked(1024, 32, 1, min_numel=0), outer={"lr": 2.4}),
    "sweep_h5_c1k_k32_b1_m0_lr30": _diloco(5, chunked(1024, 32, 1, min_numel=0), outer={"lr": 3.0}),
    "sweep_h3_c1k_k19_b1_m0_lr18": _diloco(3, chunked(1024, 19, 1, min_numel=0), outer={"lr": 1.8}),
    "sweep_h5_c1k_k32_b1_m0_d0975_lr18": _diloco(5, chunked(1024, 32, 1, decay=0.975, min_numel=0),
                                                 outer={"lr": 1.8}),
    "sweep_h10_c1k_k64_b1_m0_lr18": _diloco(10, chunked(1024, 64, 1, min_numel=0), outer={"lr": 1.8}),
}
BASELINE = "ddp_fp32"
# deepreduce's shipped semi-synchronous configs: the rows the targets are checked on
SHIPPED_SEMISYNC = ("semisync_h30", "semisync_h30_sra", "semisync_dense_h30", "semisync_chunked_h10",
                    "semisync_chunked_h10_sra", "semisync_1bit_h5")
PER_STEP_BEST = "lm_topk"
# The rows whose received bytes are compared at 2 and 4 workers (gathers against the sparse all-reduce).
GATHER_ROWS = ("demo_style_h30", "sparseloco_h30", "semisync_h30", "semisync_h30_sra", "semisync_chunked_h10",
               "semisync_chunked_h10_sra", "semisync_chunked_h10_flat_sra", "semisync_1bit_h5_sra",
               "semisync_1bit_h5_flat_sra")
OUTER_LR = {"nesterov": {"lr": 0.7, "momentum": 0.9, "nesterov": True}, "average": {"lr": 1.0}}


def outer_sgd(outer) -> dict:
    """The ``torch.optim.SGD`` arguments of a method's ``outer``: a name of :data:`OUTER_LR`, or a
    dict of its own (``lr``, ``momentum``, ``nesterov``) for a row tuned apart from the named ones."""
    if isinstance(outer, str):
        if outer not in OUTER_LR:
            raise ValueError(f"semisync: unknown outer optimizer {outer!r}; known: {', '.join(OUTER_LR)} or a dict")
        return dict(OUTER_LR[outer])
    unknown = set(outer) - {"lr", "momentum", "nesterov"}
    if unknown or "lr" not in outer:
        raise ValueError(f"semisync: an outer optimizer dict needs 'lr' and may carry 'momentum' and 'nesterov', "
                         f"got {sorted(outer)}")
    return dict(outer)


@dataclass(frozen=True)
class Budget:
    """The model, the token budget and the evaluation grid (identical for every method)."""

    steps: int = 900                 # inner steps: DiLoCo at H = 30 makes 30 outer steps
    eval_every: int = 30             # a DiLoCo row evaluates at the first sync at or after each point
    eval_windows: int = 64           # validation windows of the context (over all ranks)
    batch: int = 8                   # sequences per rank per step
    lr: float = 2e-3                 # AdamW (inner optimizer of the DiLoCo rows), betas (0.9, 0.95)
    warmup: int = 30
    vocab: int = 4096
    width: int = 64
    layers: int = 2
    heads: int = 4
    context: int = 64
    h_scale: int = 1                 # the quick budget divides every H by this (at least 1)
    profile_steps: int = 24          # time phase: timed inner steps per method
    profile_sync: int = 4            # time phase: DiLoCo rows sync every this many steps while profiled

    def model(self):
        from ..lm.model import LMConfig

        return LMConfig(vocab_size=self.vocab, context=self.context, width=self.width, layers=self.layers,
                        heads=self.heads)

    def key(self) -> str:
        """A short tag of every field that changes the training (cache file names carry it)."""
        fields = (self.steps, self.eval_every, self.eval_windows, self.batch, self.lr, self.warmup, self.vocab,
                  self.width, self.layers, self.heads, self.context, self.h_scale)
        return "b" + "-".join(str(f) for f in fields)


FULL = Budget()
QUICK = Budget(steps=12, eval_every=4, eval_windows=8, batch=2, warmup=4, vocab=4096, width=32, context=32,
               h_scale=10, profile_steps=6, profile_sync=3)


def budget(quick: bool, steps: Optional[int] = None, plans: Optional[Sequence[Budget]] = None,
           what: str = "semisync") -> Budget:
    """The quick or the full budget (``plans``: ``(full, quick)`` of another benchmark; default this
    one's), with ``steps`` steps if given (evaluating at least at the end)."""
    full, quick_plan = plans or (FULL, QUICK)
    chosen = quick_plan if quick else full
    if steps is not None:
        if steps < 1:
            raise ValueError(f"{what}: steps must be at least 1, got {steps}")
        chosen = replace(chosen, steps=steps, eval_every=min(chosen.eval_every, steps))
    return chosen


def sync_every(method: dict, plan: Budget) -> int:
    """The H a DiLoCo row runs at under ``plan`` (1 for the every-step rows)."""
    if method["kind"] != "diloco":
        return 1
    return max(1, method["sync_every"] // plan.h_scale)


def eval_steps(method: dict, plan: Budget) -> List[int]:
    """The steps after which ``method`` is evaluated: every ``eval_every`` steps, a DiLoCo row at
    the first outer step at or after each point (its workers then hold the global parameters),
    and always after the last step."""
    h = sync_every(method, plan)
    every = -(-plan.eval_every // h) * h
    steps = list(range(every, plan.steps + 1, every))
    if not steps or steps[-1] != plan.steps:
        steps.append(plan.steps)
    return steps


def select(names: Optional[Sequence[str]]) -> List[str]:
    """The methods to run, in table order, with the DDP fp32 baseline always first."""
    if not names:
        return list(METHODS)
    unknown = [n for n in names if n not in METHODS and n not in SWEEP]
    if unknown:
        raise ValueError(f"semisync: unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)} "
                         f"and the sweep's {', '.join(SWEEP)}")
    return [n for n in {**METHODS, **SWEEP} if n == BASELINE or n in names]


def spec(name: str) -> dict:
    """The method dict of a row of :data:`METHODS` or :data:`SWEEP`."""
    return METHODS[name] if name in METHODS else SWEEP[name]
