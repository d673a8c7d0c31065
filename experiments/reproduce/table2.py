"""DeepReduce Table 2: the inherently sparse model, no sparsifier.

Input: every recorded gradient of the NCF-style recommender in the corpus (embedding tables
plus MLP; about 40% exact zeros). Each configuration keeps exactly the non-zero entries
(sparsifier ``none``) and compresses their positions and values; tensors below the pipeline's
``min_numel`` travel dense, as they would in training. ``volume`` is all container bytes over
all dense float32 bytes, the paper's "relative data volume"; ``rel_err`` is the relative L2
error of the reconstruction against the gradient.

Configurations (paper §6.3 parameters; the project's ``configs/<name>.yaml`` files define them):

* ``DR^QSGD_BF-P0`` (``bfp0_qsgd``): Bloom filter P0 at FPR 0.6 for indices, QSGD 7-bit (127 levels), bucket 512;
* ``DR^Fit-Poly_BF-P2`` (``bfp2_polyfit``): Bloom filter P2 at FPR 0.01, piece-wise degree-5 polynomial values;
* ``SKCompress`` (``skcompress``): delta + Huffman keys, SketchML quantile-bucket values (7-bit), without grouped
  MinMaxSketch and without sign separation, as the paper configures it.

Two reference rows: the dense baseline (volume 1) and raw <key, value> pairs.

Quality (``best_hr``, the paper's "best hit rate"): each method also trains the recommender
for a few epochs with :func:`train_hit_rate` (two simulated data-parallel workers whose
gradients go through the method's encode/decode) and reports the best HR@10.
"""
from __future__ import annotations

from .common import ErrorAccumulator, Result, named_config, no_plot_note, progress, pyplot, save_figure, try_build

NONE = {"id": "none"}
KEY_VALUE = {"sparsifier": NONE, "index": {"id": "raw"}, "value": {"id": "raw"}, "memory": NONE}
CONFIGS = {"DR^QSGD_BF-P0": "bfp0_qsgd", "DR^Fit-Poly_BF-P2": "bfp2_polyfit", "SKCompress": "skcompress"}
PAPER = {"DR^QSGD_BF-P0": 0.2063, "DR^Fit-Poly_BF-P2": 0.5879, "SKCompress": 0.2175, "baseline (dense)": 1.0}
PAPER_HR = {"DR^QSGD_BF-P0": 0.9496, "DR^Fit-Poly_BF-P2": 0.9519, "SKCompress": 0.9513, "baseline (dense)": 0.9497}
WORKERS = 2
DEFAULT_EPOCHS = 3


def train_hit_rate(config, data, epochs: int, batch: int, workers: int = WORKERS, seed: int = 0):
    """Best HR@10 of the recommender trained data-parallel with ``config`` (None: exact average).

    ``workers`` simulated ranks in one process: each step every worker computes the gradient
    of its share of the global batch, encodes it with its own pipeline (own error-feedback
    state), and every gradient is decoded and averaged, exactly what the allgather path does
    on real ranks, without the network. Returns ``(best_hr, per_epoch_hr)``.
    """
    import torch
    from torch.nn import functional as F

    from deepreduce.config import build

    from ..models.ncf import NCF, hit_rate

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        model = NCF(data.n_users, data.n_items)
        opt = torch.optim.Adam(model.parameters(), lr=0.002)
        params = list(model.named_parameters())
        pipes = [build(config) for _ in range(workers)] if config is not None else None
        history = []
        step = 0
        for epoch in range(epochs):
            for users, items, labels in data.epoch(epoch, batch * workers, seed=seed):
                summed = [torch.zeros_like(p) for _, p in params]
                for w in range(workers):
                    part = slice(w * batch, (w + 1) * batch)
                    opt.zero_grad()
                    F.binary_cross_entropy_with_logits(
                        model(torch.from_numpy(users[part]), torch.from_numpy(items[part])),
                        torch.from_numpy(labels[part])).backward()
                    for acc, (name, p) in zip(summed, params):
                        if pipes is None:
                            acc += p.grad
                        else:
                            payload = pipes[w].encode(p.grad.numpy(), name=name, step=step)
                            acc += torch.from_numpy(pipes[0].decode(payload, tuple(p.shape)))
                for acc, (_, p) in zip(summed, params):
                    p.grad = acc / workers
                opt.step()
                step += 1
            history.append(hit_rate(model, data.test_items, data.test_negatives))
        return max(history), history
    finally:
        torch.set_num_threads(threads)


def run(out_dir: str, quick: bool = False, corpus=None, configs_dir: str = None, epochs: int = None,
        show_progress: bool = True) -> Result:
    from .. import corpus as corpus_mod
    from ..recsys_data import generate

    corpus = corpus or corpus_mod.load(corpus_mod.QUICK if quick else corpus_mod.FULL)
    tensors = list(corpus.tensors("ncf"))
    zero_fraction = corpus.zero_fraction("ncf")
    result = Result("table2", "Table 2 - inherently sparse NCF-style recommender, no sparsifier: relative data volume",
                    ["method", "volume", "paper_volume", "index_vol", "value_vol", "rel_err", "encode_ms", "decode_ms",
                     "best_hr", "paper_hr"])
    result.rows.append({"method": "baseline (dense)", "volume": 1.0, "paper_volume": 1.0, "index_vol": 0.0,
                        "value_vol": 1.0, "rel_err": 0.0})
    configs = {"<key,value> raw": KEY_VALUE}
    for label, stem in CONFIGS.items():
        config = named_config(stem, result, configs_dir)
        if config is not None:
            configs[label] = config
    for label in progress(list(configs), "table2", enabled=show_progress):
        pipe = try_build(configs[label], label, result)
        if pipe is None:
            continue
        err = ErrorAccumulator()
        for name, step, grad in tensors:
            decoded = pipe.decode(pipe.encode(grad, name=name, step=step))
            err.add(decoded.ravel(), grad.ravel())
        s = pipe.stats
        result.rows.append({"method": label, "volume": s.relative_volume, "paper_volume": PAPER.get(label),
                            "index_vol": s.index_bytes / s.dense_bytes,
                            "value_vol": (s.value_bytes + s.permutation_bytes) / s.dense_bytes,
                            "rel_err": err.value, "encode_ms": 1e3 * s.encode_seconds / max(1, s.tensors_encoded),
                            "decode_ms": 1e3 * s.decode_seconds / max(1, s.tensors_decoded)})
    epochs = DEFAULT_EPOCHS if epochs is None else epochs
    if quick:
        epochs = min(epochs, 1)
    if epochs > 0:
        spec = corpus_mod.QUICK if quick else corpus_mod.FULL
        data = generate(spec.ncf_data)
        batch = spec.ncf_batch
        for row in progress(result.rows, "table2 training", enabled=show_progress):
            config = None if row["method"] == "baseline (dense)" else configs[row["method"]]
            row["best_hr"], row["hr_per_epoch"] = train_hit_rate(config, data, epochs, batch)
            row["paper_hr"] = PAPER_HR.get(row["method"])
        result.notes.append(f"best_hr: best HR@10 over {epochs} epoch(s) of {WORKERS} simulated data-parallel "
                            f"workers (local batch {batch}, Adam), leave-one-out with 99 negatives; "
                            "the paper's is on ML-20M after full training")
    numel = sum(g.size for _, _, g in tensors)
    result.notes.append(f"{len(tensors)} gradients ({numel:,} elements in all), {100 * zero_fraction:.1f}% exact zeros "
                        "(the paper's NCF: about 40%); times are per tensor (mean), single process, CPU")
    result.extra.update(zero_fraction=zero_fraction, tensors=len(tensors), elements=numel)
    _plot(result, out_dir)
    return result


def _plot(result: Result, out_dir: str) -> None:
    plt = pyplot()
    if plt is None:
        no_plot_note(result)
        return
    rows = result.rows
    x = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.2 for i in x], [r["volume"] for r in rows], width=0.4, label="measured")
    paper = [(i, r["paper_volume"]) for i, r in zip(x, rows) if r.get("paper_volume") is not None]
    ax.bar([i + 0.2 for i, _ in paper], [v for _, v in paper], width=0.4, label="paper (ML-20M)")
    ax.set_xticks(x)
    ax.set_xticklabels([r["method"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("relative data volume")
    ax.set_title("Inherently sparse NCF, no sparsifier")
    hr = [(i, r["best_hr"]) for i, r in zip(x, rows) if r.get("best_hr") is not None]
    for i, v in hr:
        ax.annotate(f"HR {v:.3f}", (i, rows[i]["volume"]), ha="center", va="bottom", fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(result, fig, out_dir, "table2_volume.png")
