"""``deepreduce bench-chunks``'s index table on a small gradient: a row per codec and backend (the
C++ extension and the Python definition, which the command checks write the same section), the
documented bits per index, and the backend switch restored afterwards."""
import os

import pytest

from experiments.cli import bench_chunks


def test_index_rows_time_both_backends_and_restore_the_setting(monkeypatch):
    pytest.importorskip("deepreduce._chunk_enum", reason="needs the C++ extensions (make setup)")
    monkeypatch.delenv("DEEPREDUCE_BACKEND", raising=False)
    rows = bench_chunks.index_rows([1 << 14], 1024, [32], repeat=1, seed=0)
    assert [(r["codec"], r["backend"]) for r in rows] == [("chunk_fixed", "c++"), ("chunk_fixed", "python"),
                                                          ("chunk_enum", "c++"), ("chunk_enum", "python")]
    assert {r["bits"] for r in rows if r["codec"] == "chunk_fixed"} == {10.0}
    assert len({r["bits"] for r in rows if r["codec"] == "chunk_enum"}) == 1
    assert all(r["encode_ms"] >= 0 and r["decode_ms"] >= 0 for r in rows)
    assert "DEEPREDUCE_BACKEND" not in os.environ
