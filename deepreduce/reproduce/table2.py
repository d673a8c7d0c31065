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
"""
from __future__ import annotations

from .common import ErrorAccumulator, Result, named_config, no_plot_note, progress, pyplot, save_figure, try_build

NONE = {"id": "none"}
KEY_VALUE = {"sparsifier": NONE, "index": {"id": "raw"}, "value": {"id": "raw"}, "memory": NONE}
CONFIGS = {"DR^QSGD_BF-P0": "bfp0_qsgd", "DR^Fit-Poly_BF-P2": "bfp2_polyfit", "SKCompress": "skcompress"}
PAPER = {"DR^QSGD_BF-P0": 0.2063, "DR^Fit-Poly_BF-P2": 0.5879, "SKCompress": 0.2175, "baseline (dense)": 1.0}


def run(out_dir: str, quick: bool = False, corpus=None, configs_dir: str = None, show_progress: bool = True) -> Result:
    from .. import corpus as corpus_mod

    corpus = corpus or corpus_mod.load(corpus_mod.QUICK if quick else corpus_mod.FULL)
    tensors = list(corpus.tensors("ncf"))
    zero_fraction = corpus.zero_fraction("ncf")
    result = Result("table2", "Table 2 - inherently sparse NCF-style recommender, no sparsifier: relative data volume",
                    ["method", "volume", "paper_volume", "index_vol", "value_vol", "rel_err", "encode_ms", "decode_ms"])
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
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(result, fig, out_dir, "table2_volume.png")
