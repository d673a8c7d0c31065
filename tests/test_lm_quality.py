"""The language-model quality experiment: its data, tokenizer, a 2-rank run, and ``reproduce quality --quick``.

The smoke test at the end takes about a minute and a half and is marked ``slow`` (deselect it with
``-m "not slow"`` where CI time is tight); it runs where this process may create network
namespaces (root with iproute2) and is skipped with the reason elsewhere.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments.lm import data as lm_data
from experiments.lm.tokenizer import WordTokenizer
from experiments.reproduce import netns, quality
from experiments.reproduce.common import Result, named_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 8192


def _tree(root, files):
    for path, text in files.items():
        full = os.path.join(root, *path.split("/"))
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as handle:
            handle.write(text)


@pytest.fixture(scope="module")
def stdlib_data(tmp_path_factory):
    """The real corpus, built into a fresh cache (as on a new machine), and its cache file."""
    return lm_data.load(VOCAB, cache_dir=str(tmp_path_factory.mktemp("lm-cache")))


def test_source_files_leave_out_test_packages(tmp_path):
    _tree(str(tmp_path), {
        "os.py": b"import sys\n", "json/decoder.py": b"x = 1\n", "json/README": b"not python\n",
        "test/test_os.py": b"", "unittest/test/test_case.py": b"", "lib2to3/tests/data/f.py": b"",
        "idlelib/idle_test/test_x.py": b"", "idlelib/editor.py": b"y = 2\n", "site-packages/pkg/m.py": b"",
        "__pycache__/os.py": b"", "distutils/tests/test_a.py": b"",
    })
    assert lm_data.source_files(str(tmp_path)) == ["idlelib/editor.py", "json/decoder.py", "os.py"]


def test_stdlib_split_is_deterministic_and_has_no_test_file():
    paths = lm_data.source_files()
    assert len(paths) > 300
    for path in paths:
        assert not set(path.split("/")[:-1]) & lm_data.EXCLUDED_DIRS, path
    train, valid = lm_data.split(paths)
    assert (train, valid) == lm_data.split(paths)
    assert not set(train) & set(valid) and len(train) + len(valid) == len(paths)
    assert 0.05 < len(valid) / len(paths) < 0.2
    # SHA-256 of the relative path, never Python's salted hash: pinned answers
    assert [lm_data.is_validation(p) for p in ("bz2.py", "calendar.py", "os.py", "argparse.py")] == \
        [True, True, False, False]


def test_same_batches_on_every_run(stdlib_data, tmp_path):
    data, path = stdlib_data
    again = lm_data.read(path)                      # a second run reads the cache
    np.testing.assert_array_equal(again.train, data.train)
    assert again.tokenizer.pieces == data.tokenizer.pieces
    rebuilt = lm_data.build(VOCAB)                  # and one without a cache builds the same
    np.testing.assert_array_equal(rebuilt.valid, data.valid)
    ids, targets = data.batch(7, 1, batch=4, context=32)
    again_ids, again_targets = again.batch(7, 1, batch=4, context=32)
    np.testing.assert_array_equal(ids, again_ids)
    np.testing.assert_array_equal(targets, again_targets)
    assert ids.shape == targets.shape == (4, 32) and ids.dtype == np.int64
    np.testing.assert_array_equal(ids[:, 1:], targets[:, :-1])      # targets are the next tokens
    assert not np.array_equal(data.batch(7, 0, 4, 32)[0], ids)       # the other rank's batch differs
    assert not np.array_equal(data.batch(8, 1, 4, 32)[0], ids)       # and so does the next step's
    val_ids, _ = data.validation(16, 32)
    np.testing.assert_array_equal(val_ids, again.validation(16, 32)[0])


def test_tokenizer_round_trip(stdlib_data):
    texts = [b"def f(x):\n    return x + 1\n", b"\tclass  Spam(object):\r\n\t\tpass  # \xc3\xa9t\xc3\xa9\n"]
    tok = WordTokenizer.train(texts, 300)
    for text in texts + [b"unknown_identifier = 12345 \xff\xfe\x00 \x0c\n\n", b""]:
        ids = tok.encode(text)
        assert ids.dtype == np.uint16 and tok.decode(ids) == text
    assert len(tok.encode(b"    return x")) < len(b"    return x")      # pieces, not bytes
    data, _ = stdlib_data
    with open(os.path.join(lm_data.stdlib_root(), "argparse.py"), "rb") as handle:
        source = handle.read()
    ids = data.tokenizer.encode(source)
    assert data.tokenizer.decode(ids) == source and data.bytes_of(ids) == len(source)
    assert len(source) / ids.size > 2.0                  # a word-level vocabulary, several bytes per token
    with pytest.raises(ValueError, match="vocab_size"):
        WordTokenizer.train(texts, 256)


def test_two_ranks_train_with_a_deepreduce_config(stdlib_data, tmp_path):
    """Two gloo ranks (loopback), a small model, Top-r 1% through deepreduce's DDP hook: the loss falls."""
    _, path = stdlib_data
    config = named_config("topk_raw", Result("t", "t", []))
    model = {"vocab_size": VOCAB, "context": 32, "width": 64, "layers": 1, "heads": 2}
    events = str(tmp_path / "events.jsonl")
    base = netns.python_module("experiments.reproduce.quality_worker", "--world", "2",
                               "--methods", json.dumps([["topk_raw", config]]), "--data", path,
                               "--model", json.dumps(model), "--steps", "12", "--batch", "8", "--lr", "5e-3",
                               "--warmup", "2", "--eval-every", "6", "--eval-windows", "32", "--profile-steps", "2",
                               "--timeout", "60", "--init", f"tcp://127.0.0.1:{29600 + os.getpid() % 200}")
    netns.launch_ranks(None, [base + ["--rank", "0", "--events", events], base + ["--rank", "1"]],
                       str(tmp_path / "worker"), timeout=120, what="2-rank LM")
    run = quality.read_events(events)["topk_raw"]
    losses = [e["val_loss"] for e in run["curve"]]
    assert [e["step"] for e in run["curve"]] == [0, 6, 12]
    assert losses[-1] < losses[0] - 0.2, losses
    summary = run["summary"]
    assert 0 < summary["bytes_per_step"] < 0.05 * summary["dense_bytes"]      # Top-r 1% with raw indices
    assert summary["step_s"] > 0 and summary["codec_s"] > 0


def _our_namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith(("drns0-", "drns1-", "drprobe"))}


@pytest.mark.slow
def test_reproduce_quality_quick(tmp_path):
    available, why = netns.namespaces_available()
    if not available:
        pytest.skip(f"reproduce quality needs network namespaces: {why}")
    before = _our_namespaces()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "deepreduce", "reproduce", "quality", "--quick", "--methods", "topk_raw,powersgd4,lm_qsgd",
           "--steps", "10", "--no-progress", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "quality.json", encoding="utf-8") as handle:
        result = json.load(handle)
    rows = {(r["network"], r["method"]): r for r in result["rows"]}
    methods = ("dense", "powersgd4", "topk_raw", "lm_qsgd")
    assert set(rows) == {(net, m) for net, _ in quality.BANDWIDTHS for m in methods}
    assert all("tbf" in q for q in result["extra"]["qdisc"].values())
    for net, _ in quality.BANDWIDTHS:
        assert rows[(net, "dense")]["volume"] == 1.0 and rows[(net, "dense")]["time_to_dense_s"] > 0
        assert rows[(net, "topk_raw")]["volume"] < 0.05 and rows[(net, "powersgd4")]["volume"] < 0.1
        assert rows[(net, "lm_qsgd")]["volume"] < 0.35         # every entry in 8 bits, a run-length index
        for row in (rows[(net, m)] for m in methods):
            assert row["final_loss"] < 9.0 and row["step_ms"] >= row["comm_ms"] > 0
    # at 100 Mbit/s the dense all-reduce is paced by the link (the sizing the experiment relies on)
    assert rows[("100mbit", "dense")]["comm_ms"] > 0.5 * 8 * rows[("100mbit", "dense")]["bytes_per_step"] / 100e6 * 1e3
    assert any(note.startswith("recommended configs for this model") and "lm_qsgd" in note for note in result["notes"])
    assert os.path.getsize(tmp_path / "quality_loss_vs_time.png") > 1000
    assert "100mbit" in proc.stdout and "time_to_dense_s" in proc.stdout
    assert _our_namespaces() == before            # the namespaces are gone
