"""Shared helpers for the test suite: launching real multi-rank jobs."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"


def _bin(name: str) -> str:
    """A console script of the interpreter running the tests (the project's venv)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else (shutil.which(name) or name)


def launch_env() -> dict:
    """Environment for launched ranks: MPI as root, quiet TF, the project on the path."""
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TF_CPP_MIN_LOG_LEVEL="2",
               OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def run_ranks(launcher: str, script: str, *args: str, np_: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``tests/workers/<script>`` on ``np_`` ranks with ``horovodrun`` or ``mpirun``; fail with its
    output, also when the job outlives ``timeout`` seconds (workers arm ``watchdog.arm`` below that,
    so a hang shows each rank's stacks)."""
    if launcher == "horovodrun":
        cmd = [_bin("horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}"]
    elif launcher == "mpirun":
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np_), "--bind-to", "none"]
    else:
        raise ValueError(launcher)
    cmd += [sys.executable, str(WORKERS / script), *args]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} still running after {timeout} s (a hang)\nstdout:\n{_text(exc.stdout)[-4000:]}\n"
                    f"stderr:\n{_text(exc.stderr)[-8000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
                    f"stderr:\n{proc.stderr[-4000:]}")
    return proc


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


@pytest.fixture
def tmp_out(tmp_path):
    return tmp_path


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes minutes (deselect with -m 'not slow' where CI time is tight)")


def spawn_ranks(run, *args, world: int = 2, timeout: int = 240) -> dict:
    """``run(rank, world, port, queue, *args)`` on ``world`` processes started by
    torch.multiprocessing's spawn; returns ``{rank: result}`` from what each put on the queue, and
    fails with the exit codes when a rank crashed or hung (workers arm a watchdog that dumps their
    stacks on stderr)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run, args=(rank, world, port, queue, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, result = queue.get(timeout=timeout)
            results[rank] = result
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    exitcodes = [p.exitcode for p in procs]
    assert exitcodes == [0] * world, f"ranks exited with {exitcodes}; results from ranks {sorted(results)}"
    return results



def run_threads(target, args_per_rank, timeout: float, what: str = "a rank hung") -> None:
    """``target(*args)`` on one thread per entry of ``args_per_rank`` (ranks simulated in one
    process, e.g. over a thread allgather); joins them within ``timeout`` seconds each and fails
    with ``what`` when one is still running (a hang becomes a failure, not a stuck suite)."""
    threads = [threading.Thread(target=target, args=tuple(args)) for args in args_per_rank]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), what


class OneRank:
    """A communicator of one rank: its collectives hand back what it sent."""
    rank, size = 0, 1

    def alltoall(self, payloads, name):
        return list(payloads)

    def allgather(self, payload, name):
        return [payload]


class ThreadRanks:
    """``size`` ranks as threads of this process exchanging through shared slots (a barrier
    between writing and reading): the collectives of the sparse all-reduce without a launcher.
    ``calls``: the name of every collective, as rank 0 made them."""

    def __init__(self, size):
        self.size, self.barrier, self.slots = size, threading.Barrier(size, timeout=60), {}
        self.calls = []

    def rank_view(self, rank):
        ranks = self

        class View:
            def __init__(self):
                self.rank, self.size = rank, ranks.size

            def alltoall(self, payloads, name):
                return ranks.exchange(rank, name, list(payloads), lambda sent, j: sent[j][rank])

            def allgather(self, payload, name):
                return ranks.exchange(rank, name, payload, lambda sent, j: sent[j])

        return View()

    def exchange(self, rank, name, mine, pick):
        if rank == 0:
            self.calls.append(name)
        self.slots[(name, rank)] = mine
        self.barrier.wait()
        got = [pick({j: self.slots[(name, j)] for j in range(self.size)}, j) for j in range(self.size)]
        self.barrier.wait()
        return got


@pytest.fixture
def kernel_threads(monkeypatch):
    """``record(*names)``: from then on the C++ kernels ``names`` of ``deepreduce._select`` (through
    ``kernels.native()``) note the ``threads`` they are called with, their last argument, in the
    returned list as ``(name, threads)``; skips without the extensions."""
    from deepreduce.backend import kernels
    module = kernels.native()
    if module is None:
        pytest.skip("needs the C++ extensions (make setup)")

    def record(*names):
        seen = []

        class Recording:
            def __getattr__(self, attr):
                kernel = getattr(module, attr)
                if attr not in names:
                    return kernel

                def call(*args):
                    seen.append((attr, args[-1]))
                    return kernel(*args)
                return call

        monkeypatch.setattr(kernels, "native", lambda: Recording())
        return seen
    return record

