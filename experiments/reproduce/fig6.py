"""DeepReduce Fig. 6: relative data volume and error against the Bloom filter's FPR, P0/P1/P2.

The paper trains ResNet-20 for 328 epochs per point and plots top-1 accuracy; here every
point encodes and decodes the recorded ResNet-20 gradients of the corpus (every layer with at
least 1,000 elements, every recorded step) and reports what accuracy depends on: the
reconstruction error. Two errors are given, both relative L2 over all tensors:

* ``err_vs_sparse``: against the sparsifier's output (what the codec was asked to carry);
* ``err_vs_dense``: against the full gradient (what training ultimately wants). BF-P0 sends
  the true values of its false positives, so its error against the dense gradient falls below
  the sparsifier's own, while BF-P1 places values at wrong positions.

``volume`` is container bytes over dense float32 bytes; ``Top-r``/``Rand-r`` rows with raw
indices and values give the sparse input's volume (the paper's crossing point: BF-P0 sends
more than the sparse input above FPR ~0.004).
"""
from __future__ import annotations

from .common import ErrorAccumulator, Result, no_plot_note, progress, pyplot, save_figure, sparse_target, try_build

POLICIES = ("p0", "p1", "p2")
FPRS = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1)
QUICK_FPRS = (0.001, 0.01)
SPARSIFIERS = {"Top-r": {"id": "topk", "ratio": 0.01}, "Rand-r": {"id": "randomk", "ratio": 0.01}}
MIN_NUMEL = 1000


def bloom_config(sparsifier: dict, policy: str, fpr: float) -> dict:
    return {"sparsifier": sparsifier, "index": {"id": "bloom", "policy": policy, "fpr": fpr},
            "value": {"id": "raw"}, "memory": {"id": "none"}, "min_numel": 0}


def measure(pipe, tensors) -> dict:
    """Volume and errors of ``pipe`` over ``tensors`` (``(name, step, grad)`` triples)."""
    wire = dense = 0
    err_sparse, err_dense = ErrorAccumulator(), ErrorAccumulator()
    for name, step, grad in tensors:
        flat = grad.ravel().astype("float32")
        payload = pipe.encode(flat, name=name, step=step)
        decoded = pipe.decode(payload)
        wire += payload.size
        dense += 4 * flat.size
        err_sparse.add(decoded, sparse_target(pipe, flat, name, step))
        err_dense.add(decoded, flat)
    return {"volume": wire / dense, "index_volume": pipe.stats.index_bytes / dense,
            "err_vs_sparse": err_sparse.value, "err_vs_dense": err_dense.value}


def run(out_dir: str, quick: bool = False, corpus=None, show_progress: bool = True) -> Result:
    from .. import corpus as corpus_mod

    corpus = corpus or corpus_mod.load(corpus_mod.QUICK if quick else corpus_mod.FULL)
    tensors = list(corpus.tensors("resnet20", MIN_NUMEL))
    if quick:
        tensors = tensors[:4]
    fprs = QUICK_FPRS if quick else FPRS
    sparsifiers = {"Top-r": SPARSIFIERS["Top-r"]} if quick else SPARSIFIERS
    result = Result("fig6", "Fig. 6 - Bloom filter policies: relative volume and error vs FPR (ResNet-20 corpus, r = 1%)",
                    ["sparsifier", "method", "fpr", "volume", "index_volume", "err_vs_sparse", "err_vs_dense"])
    jobs = [(s, None, None) for s in sparsifiers] + [(s, p, f) for s in sparsifiers for p in POLICIES for f in fprs]
    skipped = set()
    for sname, policy, fpr in progress(jobs, "fig6", enabled=show_progress):
        if policy is None:
            config = {"sparsifier": sparsifiers[sname], "index": {"id": "raw"}, "value": {"id": "raw"},
                      "memory": {"id": "none"}, "min_numel": 0}
            label = f"{sname} (raw)"
        else:
            if policy in skipped:
                continue
            config = bloom_config(sparsifiers[sname], policy, fpr)
            label = f"BF-{policy.upper()}"
        pipe = try_build(config, f"{sname} {label} fpr={fpr}", result)
        if pipe is None:
            skipped.add(policy)
            continue
        row = measure(pipe, tensors)
        result.rows.append(dict(row, sparsifier=sname, method=label, fpr=fpr))
    result.extra["tensors"] = len(tensors)
    result.extra["layers"] = sorted({n for n, _, _ in tensors})
    result.notes.append(f"{len(tensors)} gradients (layers with >= {MIN_NUMEL} elements x recorded steps); "
                        "no error feedback; volume = container bytes / dense float32 bytes")
    _plot(result, out_dir, sparsifiers)
    return result


def _plot(result: Result, out_dir: str, sparsifiers) -> None:
    plt = pyplot()
    if plt is None:
        no_plot_note(result)
        return
    metrics = (("volume", "relative data volume"), ("err_vs_sparse", "rel. L2 error vs sparse input"),
               ("err_vs_dense", "rel. L2 error vs dense gradient"))
    fig, axes = plt.subplots(len(sparsifiers), 3, figsize=(14, 3.6 * len(sparsifiers)), squeeze=False)
    for row_axes, sname in zip(axes, sparsifiers):
        ref = [r for r in result.rows if r["sparsifier"] == sname and r["fpr"] is None]
        for policy in POLICIES:
            rows = sorted((r for r in result.rows if r["sparsifier"] == sname and r["method"] == f"BF-{policy.upper()}"),
                          key=lambda r: r["fpr"])
            if not rows:
                continue
            x = [r["fpr"] for r in rows]
            for ax, (key, _) in zip(row_axes, metrics):
                ax.plot(x, [r[key] for r in rows], marker="o", label=f"BF-{policy.upper()}")
        for r in ref:
            for ax, (key, _) in zip(row_axes, metrics):
                ax.axhline(r[key], color="grey", linestyle="--", label=f"{sname} (raw)")
        for ax, (_, ylabel) in zip(row_axes, metrics):
            ax.set_xscale("log")
            ax.set_xlabel("Bloom filter FPR")
            ax.set_ylabel(ylabel)
            ax.set_title(sname)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    save_figure(result, fig, out_dir, "fig6_fpr.png")
