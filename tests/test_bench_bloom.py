"""``deepreduce bench-bloom`` runs end to end on a small gradient and prints every row."""
import pytest

from deepreduce.backend import _native
from deepreduce.cli import main

pytestmark = pytest.mark.skipif(_native.load("bloom") is None, reason="C++ extension deepreduce._bloom not built")


def test_bench_bloom_prints_every_row_for_each_thread_count(capsys):
    assert main(["bench-bloom", "--size", "200000", "--repeat", "1", "--threads", "2", "--p2-positives", "5000"]) == 0
    out = capsys.readouterr().out
    for label in ("Top-r selection", "Bloom P0 encode+decode", "blocked (v2)", "SplitMix64 (v1)", "build of r",
                  "P2 select_conflict"):
        rows = [line for line in out.splitlines() if label in line]
        assert len(rows) == 2, label   # 1 thread and 2 threads
    assert "r = 2,000" in out and "k = 9" in out
