"""fig7 quick mode: the main job on 2 ranks under horovodrun, 1 epoch of a few steps, 2 methods."""
from __future__ import annotations

import os
import time

import pytest

from experiments.reproduce import fig7


def test_fig7_quick(tmp_path):
    out = str(tmp_path)
    result = fig7.run(out, quick=True, methods=("no compression", "BF-P2"), show_progress=False)
    result.write(out)
    assert os.path.isfile(os.path.join(out, "fig7.md")) and os.path.isfile(os.path.join(out, "fig7.json"))
    assert result.plots and os.path.getsize(result.plots[0]) > 1000
    rows = {r["method"]: r for r in result.rows}
    assert set(rows) == {"no compression", "BF-P2"}
    assert rows["no compression"]["volume"] == 1.0 and rows["no compression"]["delta_vs_baseline"] == 0
    assert 0 < rows["BF-P2"]["volume"] < 0.05                   # Top-r 1% with Bloom-coded indices
    for row in rows.values():
        assert 0.0 <= row["final_acc"] <= 1.0 and row["final_loss"] > 0
    assert [len(h) for h in result.extra["histories"].values()] == [1, 1]
    assert any(r["method"] == "BF-P2" for r in result.rows)


def _processes_mentioning(text: str):
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    if text.encode() in handle.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


def test_fig7_job_past_its_timeout_is_stopped_with_all_its_processes(tmp_path):
    # 1,000 epochs cannot end in 12 s; by then the ranks have started (they import torch and
    # Horovod), so the kill has to reach them.
    with pytest.raises(RuntimeError, match="ran past 12s"):
        fig7.launch("no compression", None, str(tmp_path), epochs=1000, max_steps=0, timeout=12)
    deadline = time.monotonic() + 10
    while _processes_mentioning(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_mentioning(str(tmp_path)) == []
