"""fig11 quick mode: two ranks in two network namespaces over a tc-shaped veth pair, deepreduce
beside PyTorch's PowerSGD and fp16 DDP hooks.

Runs for real where this process may create network namespaces (root with iproute2, as in
the project's CI container); elsewhere the experiment itself reports that the link was not
shaped and measures over loopback, and this test checks that report.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from experiments.reproduce import fig11, torch_hooks


def _our_namespaces():
    if not shutil.which("ip"):
        return set()
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith(("drns0-", "drns1-", "drprobe"))}


def test_fig11_quick(tmp_path):
    before = _our_namespaces()
    available, why = fig11.namespaces_available()
    out = str(tmp_path)
    result = fig11.run(out, quick=True, show_progress=False)
    result.write(out)
    assert os.path.isfile(os.path.join(out, "fig11.md")) and os.path.isfile(os.path.join(out, "fig11.json"))
    assert result.plots and os.path.getsize(result.plots[0]) > 1000
    networks = [r["network"] for r in result.rows]
    methods = {r["method"] for r in result.rows}
    assert "no compression (allreduce)" in methods and "Top-r 10%" in methods
    hooks = {label for label, config in fig11.METHODS if torch_hooks.is_hook(config)}
    assert hooks == {"PowerSGD rank 1 (torch DDP hook)", "PowerSGD rank 4 (torch DDP hook)",
                     "fp16 (torch DDP hook)"} and hooks <= methods
    if available:
        assert set(networks) == {name for name, _ in fig11.BANDWIDTHS}
        assert all("tbf" in q for q in result.extra["qdisc"].values())
        base = next(r for r in result.rows if r["network"] == "100mbit" and r["method"].startswith("no compression"))
        # The dense all_reduce cannot beat the shaped link: its wire time is a lower bound (at
        # 100 Mbit/s the token bucket's burst is under 5% of the quick model's gradient).
        assert base["comm_ms"] >= 0.8 * base["ideal_wire_ms"], base
    else:
        assert networks == ["loopback (unshaped)"]
        assert any(n.startswith("NOT SHAPED") and why in n for n in result.notes)
    for row in result.rows:
        assert row["compute_ms"] > 0 and row["total_ms"] >= row["comm_ms"]
        assert row["total_ms"] == pytest.approx(row["compute_ms"] + row["codec_ms"] + row["comm_ms"])
        assert row["speedup"] > 0
        if row["method"].startswith("no compression"):
            assert row["volume"] == 1.0 and row["codec_ms"] == 0
        else:
            assert 0 < row["volume"] < 1.0 and row["codec_ms"] > 0
    for net in set(networks):
        volume = {r["method"]: r["volume"] for r in result.rows if r["network"] == net}
        assert volume["fp16 (torch DDP hook)"] == 0.5               # two bytes per float32 gradient entry
        # PowerSGD compressed in the measured iterations: rank-1 factors are smaller than rank-4 ones.
        assert 0 < volume["PowerSGD rank 1 (torch DDP hook)"] < volume["PowerSGD rank 4 (torch DDP hook)"] < 0.5
    assert _our_namespaces() == before            # cleaned up after itself


@pytest.mark.skipif(not fig11.namespaces_available()[0], reason="needs root and iproute2 (network namespaces)")
def test_shaped_link_is_removed_on_error():
    link = fig11.ShapedLink()
    with pytest.raises(RuntimeError, match="boom"):
        with link:
            assert set(link.ns) <= _our_namespaces()
            raise RuntimeError("boom")
    assert not set(link.ns) & _our_namespaces()
