"""examples/train_ddp.py under torchrun against the Horovod main job: same schedule, same accuracy."""
import json
import subprocess
import sys

from conftest import ROOT, launch_env

from experiments.reproduce import fig7

EPOCHS, STEPS, CONFIG = 2, 8, "configs/topk_raw.yaml"


def test_ddp_job_matches_the_horovod_job(tmp_path):
    metrics = tmp_path / "ddp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "train_ddp.py"), "--config", CONFIG, "--epochs", str(EPOCHS),
           "--max-steps", str(STEPS), "--metrics-json", str(metrics)]
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("| rel volume ") == EPOCHS          # the Horovod job's epoch line, once per epoch
    ddp = json.loads(metrics.read_text())["epochs"]
    horovod = fig7.launch("Top-r", CONFIG, str(tmp_path), EPOCHS, STEPS, timeout=600)["epochs"]
    # The same containers per parameter and step as the Horovod optimizer, except that Horovod sums
    # parameters below min_numel by its fused all-reduce (4 bytes an element, no container header):
    # its volume is a few percent lower; up to the order of float sums, the same training.
    for d, h in zip(ddp, horovod):
        assert h["volume"] <= d["volume"] < 1.1 * h["volume"]
        assert abs(d["loss"] - h["loss"]) < 0.05
    assert ddp[-1]["loss"] < ddp[0]["loss"]
    assert ddp[-1]["acc"] >= horovod[-1]["acc"] - 0.05
