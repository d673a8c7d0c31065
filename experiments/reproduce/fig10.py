"""DeepReduce Fig. 10: volume split into indices and values, and encode/decode time, per config.

Input: one recorded gradient of a 36,864-element ResNet-20 convolution (64x64x3x3) from the
corpus. Every config of the configs directory is run with its sparsifier replaced by Top-r 1%
(r = 368), no error feedback, so all of them compress the same sparse tensor, as in the paper;
configs that then coincide (same index and value codecs) are shown once.
Times are medians over repeated single-process encode/decode calls on this machine's CPU
(the paper mixes GPU and CPU implementations, so only orders of magnitude compare).
"""
from __future__ import annotations

import glob
import os

from .common import Result, default_configs_dir, no_plot_note, progress, pyplot, save_figure, try_build, with_sparsifier

LAYER_NUMEL = 36_864
TOPR = {"id": "topk", "ratio": 0.01}
REFERENCE = "topk_raw.yaml"


def run(out_dir: str, quick: bool = False, corpus=None, configs_dir: str = None, repeat: int = None,
        show_progress: bool = True) -> Result:
    from deepreduce.config import load_config

    from .. import corpus as corpus_mod
    from ..cli.bench import measure

    corpus = corpus or corpus_mod.load(corpus_mod.QUICK if quick else corpus_mod.FULL)
    from ..gradients import DEFAULT_GRADIENT

    # The layer the value-codec benchmarks use (docs/benchmarks.md), when the corpus has it.
    names = corpus.names("resnet20")
    name = DEFAULT_GRADIENT if DEFAULT_GRADIENT in names else corpus.find("resnet20", LAYER_NUMEL)
    grad = corpus.grads["resnet20"][name][-1].ravel()
    step = corpus.meta["steps"]["resnet20"][-1]
    repeat = repeat or (2 if quick else 7)
    # Top-r with raw codecs first: the reference bar, and the name kept for its duplicates.
    paths = sorted(glob.glob(os.path.join(configs_dir or default_configs_dir(), "*.yaml")),
                   key=lambda p: (os.path.basename(p) != REFERENCE, os.path.basename(p)))
    result = Result("fig10", f"Fig. 10 - one ResNet-20 gradient ({name}, d = {grad.size}, step {step}), Top-r 1%: "
                    "volume and encode/decode time per config",
                    ["config", "index_vol", "value_vol", "header_vol", "total_vol", "encode_ms", "decode_ms",
                     "rel_err", "backend"])
    seen, duplicates = {}, {}
    for path in progress(paths, "fig10", enabled=show_progress):
        label = os.path.splitext(os.path.basename(path))[0]
        try:
            config = load_config(path)
        except Exception as exc:  # an unknown codec id or parameter: report and go on
            result.notes.append(f"skipped {label}: {exc}")
            continue
        codecs = (repr(config["index"]), repr(config["value"]))
        if codecs in seen:
            duplicates.setdefault(seen[codecs], []).append(label)
            continue          # same codecs on the same Top-r input: the same bars
        pipe = try_build(with_sparsifier(config, TOPR), label, result)
        if pipe is None:
            continue
        seen[codecs] = label
        row = measure(pipe, grad, name, repeat)
        row["header_vol"] = row["total_vol"] - row["idx_vol"] - row["val_vol"]
        result.rows.append({"config": label, "index_vol": row["idx_vol"], "value_vol": row["val_vol"],
                            "header_vol": row["header_vol"], "total_vol": row["total_vol"],
                            "encode_ms": row["encode_ms"], "decode_ms": row["decode_ms"],
                            "rel_err": row["rel_err"], "backend": row["backend"]})
    for label, same in duplicates.items():
        result.notes.append(f"{', '.join(same)}: same index and value codecs as {label} (differ only in "
                            "sparsifier or memory, which this experiment fixes), not repeated")
    result.notes.append("value_vol includes the permutation section (reordering value codecs behind a "
                        "set-only index codec); rel_err is against the Top-r output; "
                        f"times: median of {repeat} runs")
    result.extra.update(layer=name, step=step, repeat=repeat)
    _plot(result, out_dir)
    return result


def _plot(result: Result, out_dir: str) -> None:
    plt = pyplot()
    if plt is None:
        no_plot_note(result)
        return
    rows = result.rows
    labels = [r["config"] for r in rows]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(10, 0.7 * len(rows) + 4), 4.8))
    idx = [r["index_vol"] for r in rows]
    val = [r["value_vol"] for r in rows]
    hdr = [r["header_vol"] for r in rows]
    ax1.bar(x, idx, label="indices")
    ax1.bar(x, val, bottom=idx, label="values (+ permutation)")
    ax1.bar(x, hdr, bottom=[a + b for a, b in zip(idx, val)], label="header")
    # A config tuned for another input (e.g. FPR 0.6 for the NCF gradient) can dwarf the rest:
    # cap the axis at 1.5x the Top-r bar and print the value of any bar above it.
    ref = next((r["total_vol"] for r in rows if r["config"] == REFERENCE[:-5]), None)
    if ref is not None and max(r["total_vol"] for r in rows) > 1.5 * ref:
        cap = 1.5 * ref
        ax1.set_ylim(0, cap)
        for i, r in zip(x, rows):
            if r["total_vol"] > cap:
                ax1.annotate(f"{r['total_vol']:.3f}", (i, 0.97 * cap), ha="center", va="top", fontsize=7, rotation=90)
    ax1.set_ylabel("relative data volume")
    ax1.set_title("(a) data volume")
    ax1.legend(fontsize=8)
    ax2.bar([i - 0.2 for i in x], [max(r["encode_ms"], 1e-4) for r in rows], width=0.4, label="encode")
    ax2.bar([i + 0.2 for i in x], [max(r["decode_ms"], 1e-4) for r in rows], width=0.4, label="decode")
    ax2.set_yscale("log")
    ax2.set_ylabel("milliseconds (log)")
    ax2.set_title("(b) encode / decode time")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    save_figure(result, fig, out_dir, "fig10_volume_time.png")
