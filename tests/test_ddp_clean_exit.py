"""The DDP hook's state releases what it holds in order: ``close()`` (registered to run at exit)
stops the worker thread, then destroys the private process group, once. Two real gloo ranks.

Exit codes are not asserted: on this torch (2.13, gloo) a plain DDP job without any hook also
aborts at exit now and then ("terminate called without an active exception", after Python has
finalised, in C++ static teardown; docs/reliability.md), so an exit-code loop would test torch."""
import subprocess
import sys

from conftest import ROOT, WORKERS, launch_env

from experiments.processes import rendezvous_port


def test_close_stops_the_worker_before_releasing_the_private_group():
    env = dict(launch_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(rendezvous_port()), WORLD_SIZE="2")
    ranks = [subprocess.Popen([sys.executable, str(WORKERS / "ddp_short_job.py")], cwd=ROOT,
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    outputs = [proc.communicate(timeout=180) for proc in ranks]
    for rank, (out, err) in enumerate(outputs):
        assert f"OK {rank}" in out, err[-3000:]
