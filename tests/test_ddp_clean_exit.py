"""Processes with deepreduce's DDP hook exit cleanly: repeated short 2-rank jobs, each ending
without any explicit clean-up, must all exit 0 (the hook's worker thread is stopped and its
private process group released at exit, in that order; an abort here was "terminate called
without an active exception")."""
import socket
import subprocess
import sys

from conftest import ROOT, WORKERS, launch_env

JOBS = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_short_ddp_hook_jobs_all_exit_zero():
    failures = []
    for job in range(JOBS):
        env = dict(launch_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
        ranks = [subprocess.Popen([sys.executable, str(WORKERS / "ddp_short_job.py")], cwd=ROOT,
                                  env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for r in range(2)]
        for rank, proc in enumerate(ranks):
            out, err = proc.communicate(timeout=180)
            if proc.returncode != 0 or f"OK {rank}" not in out:
                failures.append(f"job {job} rank {rank}: exit {proc.returncode}\n{err[-1500:]}")
    assert not failures, "\n".join(failures)
