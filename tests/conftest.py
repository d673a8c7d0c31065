"""Shared helpers for the test suite: launching real multi-rank jobs."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from experiments.processes import rendezvous_port, run_job

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
    try:   # on a hang the launcher and every rank it started are ended (experiments.processes)
        proc = run_job(cmd, cwd=str(ROOT), env=launch_env(), timeout=timeout)
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
    torch.multiprocessing's spawn; returns ``{rank: result}`` from what each put on the queue.

    Each rank writes its stdout and stderr to a log of its own. A rank that exits without a
    result fails the launch at once; ranks still running after ``timeout`` seconds are asked for
    their stacks (SIGUSR1) and killed. Either way the failure shows every rank's exit code and the
    end of its log (workers also arm a watchdog that dumps their stacks there). A launch whose
    rendezvous port was taken by another process between choosing and binding it is retried once
    on a new port."""
    for attempt in (1, 2):
        outcome = _launch(run, args, world, timeout)
        if isinstance(outcome, dict):
            return outcome
        if attempt == 1 and "address already in use" in outcome.lower():
            continue
        pytest.fail(outcome)


def _launch(run, args: tuple, world: int, timeout: float):
    """One launch of ``spawn_ranks``: the results, or the text of the failure."""
    import queue as queues
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results: dict = {}
    port = rendezvous_port()
    with tempfile.TemporaryDirectory(prefix="deepreduce-ranks-") as logs:
        paths = [os.path.join(logs, f"rank{rank}.log") for rank in range(world)]
        channel = ctx.Queue()
        procs = [ctx.Process(target=_rank_with_log, args=(run, paths[rank], rank, world, port, channel, *args))
                 for rank in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        problem = None
        while len(results) < world and problem is None:
            try:
                rank, result = channel.get(timeout=1.0)
                results[rank] = result
                continue
            except queues.Empty:
                pass
            silent = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
            if silent:   # what a rank put just before exiting may still be in the pipe
                _drain(channel, results)
                silent = [r for r in silent if r not in results]
            if silent:
                problem = f"rank(s) {silent} exited without a result"
            elif time.monotonic() > deadline:
                problem = f"rank(s) {sorted(set(range(world)) - set(results))} still running after {timeout} s (a hang)"
        for p in procs:
            p.join(30 if problem is None else 5)
        for p in procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGUSR1)   # _rank_with_log: every thread's stack into the log
                except ProcessLookupError:   # it ended meanwhile
                    pass
        time.sleep(1.0 if any(p.is_alive() for p in procs) else 0.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        exitcodes = [p.exitcode for p in procs]
        if problem is None and exitcodes == [0] * world:
            return results
        problem = problem or f"ranks exited with {exitcodes}"
        tails = "\n".join(f"--- rank {rank} (exit code {code}), end of its log:\n{_tail(path)}"
                          for rank, (code, path) in enumerate(zip(exitcodes, paths)))
        return f"{problem}; exit codes {exitcodes}; results from ranks {sorted(results)}\n{tails}"


def _drain(channel, results: dict) -> None:
    import queue as queues

    while True:
        try:
            rank, result = channel.get(timeout=2.0)
        except queues.Empty:
            return
        results[rank] = result


def _tail(path: str, chars: int = 6000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError as exc:
        return f"(no log: {exc})"


def _rank_with_log(run, log_path: str, *rank_args) -> None:
    """A spawned rank: stdout and stderr into ``log_path``, SIGUSR1 dumps every thread's stack
    there, then ``run(*rank_args)``."""
    import faulthandler

    log = open(log_path, "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    run(*rank_args)


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

