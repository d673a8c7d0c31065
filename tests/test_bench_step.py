"""``deepreduce bench-step`` on a tiny gradient set: every row printed, ratios consistent with the
printed times and volumes, PyTorch's hooks measured in steady state (no timing assertions)."""
from __future__ import annotations

import numpy as np
import pytest

from deepreduce.cli import main
from deepreduce.errors import ConfigError
from experiments.models.resnet50_shapes import parameter_shapes
from experiments.reproduce.common import default_configs_dir

SHAPES = {"conv.weight": (16, 16, 3, 3), "fc.weight": (64, 32), "fc.bias": (10,)}
NUMEL = sum(int(np.prod(s)) for s in SHAPES.values())
HALF_UNIT = 0.0005          # the tables print three decimals


def _table(text: str) -> dict:
    rows = {}
    for line in text.splitlines():
        parts = line.rsplit(maxsplit=7)
        if len(parts) == 8 and parts[0] != "method":
            try:
                rows[parts[0].strip()] = [float(x) for x in parts[1:]]
            except ValueError:
                continue
    return rows


@pytest.mark.parametrize("order", [[], ["--interleave"], ["--device", "cpu"]])
def test_bench_step_tiny_set(tmp_path, capsys, order):
    rng = np.random.default_rng(0)
    path = tmp_path / "tiny.npz"
    np.savez(path, **{name: rng.laplace(size=shape).astype(np.float32) for name, shape in SHAPES.items()})
    config = f"{default_configs_dir()}/topk_raw.yaml"
    assert main(["bench-step", "--gradients", str(path), "--steps", "2", "--warmup", "0", *order, config]) == 0
    rows = _table(capsys.readouterr().out)
    assert set(rows) == {"dense (no compression)", "fp16", "PowerSGD rank 1", "PowerSGD rank 4", "topk_raw",
                         "torch.topk (1%)"}
    ref_total, ref_bytes = rows["PowerSGD rank 4"][2], rows["PowerSGD rank 4"][3]
    for name, (encode, decode, total, nbytes, volume, time_ratio, volume_ratio) in rows.items():
        assert min(encode, decode, total) >= 0 and nbytes > 0, name
        low = (total - HALF_UNIT) / (ref_total + HALF_UNIT) - HALF_UNIT
        high = (total + HALF_UNIT) / max(ref_total - HALF_UNIT, 1e-12) + HALF_UNIT
        assert low <= time_ratio <= high, (name, total, ref_total, time_ratio)
        assert volume_ratio == pytest.approx(nbytes / ref_bytes, abs=HALF_UNIT), name
        assert volume == pytest.approx(nbytes / (4 * NUMEL), abs=HALF_UNIT), name
    assert rows["dense (no compression)"][3] == 4 * NUMEL
    assert rows["fp16"][3] == 2 * NUMEL
    # PowerSGD rank 4 in steady state: both matrices compressed (P and Q factors), the bias
    # all-reduced as is: 4 bytes x (16*4 + 144*4 + 64*4 + 32*4 + 10).
    assert rows["PowerSGD rank 4"][3] == 4 * (16 * 4 + 144 * 4 + 64 * 4 + 32 * 4 + 10)
    assert 0 < rows["topk_raw"][4] < 1
    # the selection alone: int64 positions of 1% of each tensor (at least one)
    assert rows["torch.topk (1%)"][3] == 8 * sum(max(1, int(0.01 * np.prod(s))) for s in SHAPES.values())


@pytest.mark.parametrize("argv, message", [
    (["--sets", "resnet99"], "unknown gradient set 'resnet99'"),
    (["--gradients", "missing.npz"], "no gradient file 'missing.npz'"),
    (["--ranks", "0"], "--ranks and --steps must be at least 1"),
    (["--threads", "many"], r"--threads: 'threads' must be an integer in \[1, 256\] or 'auto', got 'many'"),
])
def test_bench_step_rejects_bad_arguments(argv, message):
    with pytest.raises(ConfigError, match=message):
        main(["bench-step", "--steps", "1", *argv])


def test_resnet50_shapes_match_the_architecture():
    shapes = parameter_shapes()
    assert len(shapes) == 161
    assert sum(int(np.prod(shape)) for _, shape in shapes) == 25_557_032
    assert shapes[0] == ("conv1.weight", (64, 3, 7, 7)) and shapes[-1] == ("fc.bias", (1000,))
    assert dict(shapes)["layer4.0.downsample.0.weight"] == (2048, 1024, 1, 1)


def test_bench_step_buckets(tmp_path, capsys):
    # 0.01 MiB holds neither of the two large tensors with the other: each travels on its own,
    # so the bucketed row sends exactly the per-tensor containers; 25 MiB puts both in one bucket.
    rng = np.random.default_rng(1)
    path = tmp_path / "tiny.npz"
    np.savez(path, **{name: rng.laplace(size=shape).astype(np.float32) for name, shape in SHAPES.items()})
    config = f"{default_configs_dir()}/topk_raw.yaml"
    for cap in ("0.01", "25"):
        assert main(["bench-step", "--gradients", str(path), "--steps", "2", "--warmup", "0",
                     "--bucket-mb", cap, config]) == 0
        rows = _table(capsys.readouterr().out)
        bucketed = rows[f"topk_raw ({cap} MiB buckets)"]
        assert min(bucketed[:4]) > 0
        if cap == "0.01":
            assert bucketed[3] == rows["topk_raw"][3]
        else:
            assert bucketed[3] != rows["topk_raw"][3]
    with pytest.raises(ConfigError, match="--bucket-mb: bucket_cap_mb must be a positive number"):
        main(["bench-step", "--gradients", str(path), "--steps", "1", "--bucket-mb", "0", config])
