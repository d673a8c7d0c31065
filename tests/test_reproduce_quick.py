"""Quick modes of the corpus-based reproduction experiments (fig6, fig10, table2) and their parts."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepreduce.cli import main
from experiments import corpus as corpus_mod
from experiments.recsys_data import ZipfConfig, generate
from experiments.reproduce import common, fig6, fig10, get, table2
from experiments.reproduce.fig11_worker import fuse, unfuse

TINY_DATA = ZipfConfig(n_users=60, n_items=150, mean_interactions=8.0)


@pytest.fixture(scope="module")
def quick_corpus(tmp_path_factory):
    return corpus_mod.load(corpus_mod.QUICK, cache_dir=str(tmp_path_factory.mktemp("corpus")))


# ------------------------------------------------------------------ data and model
def test_zipf_data_is_deterministic_and_well_formed():
    a, b = generate(TINY_DATA), generate(TINY_DATA)
    assert np.array_equal(a.train_items, b.train_items) and np.array_equal(a.test_negatives, b.test_negatives)
    c = generate(ZipfConfig(n_users=60, n_items=150, mean_interactions=8.0, seed=1))
    assert not np.array_equal(a.train_items, c.train_items)
    per_user = np.bincount(a.train_users, minlength=a.n_users)
    assert per_user.min() >= TINY_DATA.min_interactions - 1          # one held out per user
    for u in range(a.n_users):                                         # negatives never picked by the user
        picked = set(a.train_items[a.train_users == u]) | {a.test_items[u]}
        assert not picked & set(a.test_negatives[u])
        assert len(set(a.test_negatives[u])) == TINY_DATA.test_negatives


def test_zipf_popularity_is_long_tailed():
    data = generate(ZipfConfig(n_users=400, n_items=300, mean_interactions=20.0, affinity=0.0))
    counts = np.sort(np.bincount(data.train_items, minlength=data.n_items))[::-1]
    # With affinity 0 the choice follows the Zipf(1) prior: the top 10% of items take far more
    # than 10% of the interactions.
    assert counts[:30].sum() > 0.3 * counts.sum()


def test_epoch_shards_are_disjoint_and_equal():
    data = generate(TINY_DATA)
    sizes = []
    for rank in (0, 1):
        batches = list(data.epoch(0, 16, negatives=2, rank=rank, size=2))
        sizes.append(len(batches))
        assert all(u.shape == (16,) and set(np.unique(lab)) <= {0.0, 1.0} for u, _, lab in batches)
    assert sizes[0] == sizes[1] > 0


def test_ncf_gradients_are_inherently_sparse_and_hit_rate_in_range():
    import torch
    from torch.nn import functional as F

    from experiments.models.ncf import NCF, hit_rate

    data = generate(TINY_DATA)
    torch.manual_seed(0)
    model = NCF(data.n_users, data.n_items, gmf_dim=4, mlp_dim=8, hidden=(8,))
    users, items, labels = next(data.epoch(0, 8))
    F.binary_cross_entropy_with_logits(model(torch.from_numpy(users), torch.from_numpy(items)),
                                       torch.from_numpy(labels)).backward()
    grad = model.user_gmf.weight.grad.numpy()
    touched = np.unique(users)
    assert np.all(grad[np.setdiff1d(np.arange(data.n_users), touched)] == 0)
    assert 0.0 <= hit_rate(model, data.test_items, data.test_negatives) <= 1.0


def test_corpus_round_trip_and_lookup(quick_corpus, tmp_path):
    path = str(tmp_path / "c.npz")
    quick_corpus.save(path)
    again = corpus_mod.Corpus.load(path)
    assert again.meta == quick_corpus.meta
    for model in corpus_mod.MODELS:
        for name in quick_corpus.names(model):
            assert np.array_equal(again.grads[model][name], quick_corpus.grads[model][name])
    name = quick_corpus.find("resnet20", 36_864)
    assert quick_corpus.grads["resnet20"][name].shape[1:] == (64, 64, 3, 3)
    assert 0.2 < quick_corpus.zero_fraction("ncf") < 0.6
    with pytest.raises(KeyError):
        quick_corpus.find("resnet20", 7)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.binary(max_size=40), min_size=1, max_size=6))
def test_fuse_unfuse_round_trip(chunks):
    payloads = [np.frombuffer(c, dtype=np.uint8) for c in chunks]
    back = unfuse(fuse(payloads), len(payloads))
    assert [bytes(b) for b in back] == chunks


def test_unfuse_rejects_a_truncated_buffer():
    fused = fuse([np.arange(5, dtype=np.uint8), np.arange(3, dtype=np.uint8)])
    with pytest.raises(ValueError, match="announces"):
        unfuse(fused[:-1], 2)


def test_markdown_table_formatting():
    text = common.markdown_table(["a", "b", "c"], [{"a": "x", "b": 0.123456, "c": None}, {"a": 1, "b": 1e-6}])
    assert text.splitlines()[0] == "| a | b | c |"
    assert "| x | 0.1235 | - |" in text and "1.000e-06" in text


def test_unknown_experiment_is_named():
    with pytest.raises(ValueError, match="fig6"):
        get("fig99")


# ------------------------------------------------------------------ experiments (quick mode)
def _assert_outputs(result, out):
    for ext in ("md", "json"):
        assert os.path.isfile(os.path.join(out, f"{result.name}.{ext}"))
    assert result.plots and all(os.path.getsize(p) > 1000 and p.endswith(".png") for p in result.plots)


def test_fig6_quick(quick_corpus, tmp_path):
    out = str(tmp_path)
    result = fig6.run(out, quick=True, corpus=quick_corpus, show_progress=False)
    result.write(out)
    _assert_outputs(result, out)
    ref = next(r for r in result.rows if r["method"] == "Top-r (raw)")
    assert ref["err_vs_sparse"] == 0.0 and 0.02 < ref["volume"] < 0.03   # 1% of 32-bit index + value
    for policy in fig6.POLICIES:
        rows = sorted((r for r in result.rows if r["method"] == f"BF-{policy.upper()}"), key=lambda r: r["fpr"])
        assert [r["fpr"] for r in rows] == list(fig6.QUICK_FPRS)
        assert all(r["index_volume"] < ref["index_volume"] for r in rows)   # Bloom beats 32-bit indices
    p0 = [r for r in result.rows if r["method"] == "BF-P0"]
    p1 = sorted((r for r in result.rows if r["method"] == "BF-P1"), key=lambda r: r["fpr"])
    # P0 only adds true values: never further from the dense gradient than Top-r itself.
    assert all(r["err_vs_dense"] <= ref["err_vs_dense"] + 1e-9 for r in p0)
    # P1 sends r values whatever the FPR: a larger FPR shrinks the filter and the volume.
    assert p1[-1]["volume"] <= p1[0]["volume"]


def test_fig10_quick_every_config_and_skips_unknown(quick_corpus, tmp_path):
    cfg = tmp_path / "configs"
    cfg.mkdir()
    (cfg / "a_topk_raw.yaml").write_text("sparsifier: {id: topk, ratio: 0.05}\nindex: {id: raw}\n"
                                         "value: {id: raw}\nmemory: {id: residual}\n")
    (cfg / "b_bloom_p2.yaml").write_text("sparsifier: {id: none}\nindex: {id: bloom, policy: p2, fpr: 0.001}\n"
                                         "value: {id: raw}\nmemory: {id: none}\n")
    (cfg / "c_unknown.yaml").write_text("sparsifier: {id: none}\nindex: {id: no_such_codec}\n"
                                        "value: {id: raw}\nmemory: {id: none}\n")
    out = str(tmp_path / "out")
    result = fig10.run(out, quick=True, corpus=quick_corpus, configs_dir=str(cfg), show_progress=False)
    result.write(out)
    _assert_outputs(result, out)
    assert [r["config"] for r in result.rows] == ["a_topk_raw", "b_bloom_p2"]
    assert any("c_unknown" in n and "no_such_codec" in n for n in result.notes)
    raw = result.rows[0]
    # The sparsifier is forced to Top-r 1% of 36,864 = 368 entries: 368 * 4 bytes per section.
    assert raw["index_vol"] == pytest.approx(368 / 36_864) and raw["value_vol"] == pytest.approx(368 / 36_864)
    for row in result.rows:
        assert row["total_vol"] == pytest.approx(row["index_vol"] + row["value_vol"] + row["header_vol"])
    assert result.rows[1]["index_vol"] < raw["index_vol"]


def test_table2_quick(quick_corpus, tmp_path):
    out = str(tmp_path)
    result = table2.run(out, quick=True, corpus=quick_corpus, show_progress=False)
    result.write(out)
    _assert_outputs(result, out)
    methods = [r["method"] for r in result.rows]
    assert methods[:2] == ["baseline (dense)", "<key,value> raw"]
    kv = result.rows[1]
    assert kv["rel_err"] == 0.0 and kv["volume"] > 1.0        # 64 bits per non-zero beats nothing at 60% density
    for row in result.rows[2:]:
        assert row["volume"] < kv["volume"] and row["paper_volume"] == table2.PAPER[row["method"]]
    assert all(0.0 <= r["best_hr"] <= 1.0 and len(r["hr_per_epoch"]) == 1 for r in result.rows)
    # Lossless <key, value> pairs train exactly like the dense average.
    assert result.rows[1]["best_hr"] == pytest.approx(result.rows[0]["best_hr"], abs=0.02)
    skipped = [n for n in result.notes if n.startswith("skipped")]
    assert len(result.rows) - 2 + len(skipped) == len(table2.CONFIGS)


def test_cli_prints_table_and_writes_files(tmp_path, capsys, monkeypatch, quick_corpus):
    monkeypatch.setattr(corpus_mod, "load", lambda spec, **kw: quick_corpus)
    out = str(tmp_path / "cli")
    assert main(["reproduce", "table2", "--out", out, "--quick", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "| method | volume |" in text and "table2: done" in text
    with open(os.path.join(out, "table2.json"), encoding="utf-8") as handle:
        data = json.load(handle)
    assert data["plots"] == ["table2_volume.png"] and os.path.isfile(os.path.join(out, "table2_volume.png"))


def test_fig11_batches_run_across_epochs_and_bad_accumulate_is_refused(tmp_path):
    from experiments.reproduce import fig11
    from experiments.reproduce.fig11_worker import _batches

    data = generate(TINY_DATA)
    per_epoch = len(list(data.epoch(0, 64, rank=0, size=2)))
    stream = _batches(data, 64, 0, 2)
    drawn = [next(stream) for _ in range(2 * per_epoch + 1)]
    assert all(u.shape == (64,) for u, _, _ in drawn)
    assert not np.array_equal(drawn[0][1], drawn[per_epoch][1])      # epoch 1 is reshuffled
    with pytest.raises(ValueError, match="accumulate"):
        fig11.run(str(tmp_path), quick=True, accumulate=0, show_progress=False)
