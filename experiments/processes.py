"""Launching multi-rank jobs without leaving ranks behind.

``horovodrun`` starts ``mpirun`` in a session of its own and ``mpirun`` puts each rank in a process
group of its own, so ending the launcher, its process group or its session leaves the ranks
running: on a shared machine they keep spinning on the cores (and holding their ports) through
whatever runs next. :func:`kill_tree` ends the whole job; :func:`run_job` runs a launcher and
calls it when the job outlives its timeout.
"""
from __future__ import annotations

import os
import signal
import subprocess
from typing import Mapping, Optional, Sequence


def kill_tree(root: int) -> None:
    """SIGKILL ``root``, every descendant, and every process in a session one of them leads
    (the process tree from Linux ``/proc``; the session sweep catches ranks that were re-parented
    while the tree was read)."""
    parents, sessions = {}, {}
    for entry in (os.listdir("/proc") if os.path.isdir("/proc") else []):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()   # after the command name, which may hold spaces
            parents[int(entry)] = int(fields[1])
            sessions[int(entry)] = int(fields[3])
        except (OSError, ValueError, IndexError):
            pass      # gone meanwhile
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in tree:
                tree.add(pid)
                frontier.append(pid)
    leaders = {pid for pid in tree if sessions.get(pid) == pid}
    victims = tree | {pid for pid, sid in sessions.items() if sid in leaders}
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass      # gone meanwhile, or not ours to signal


def run_job(cmd: Sequence[str], *, timeout: float, env: Optional[Mapping[str, str]] = None,
            cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` for a launcher (``horovodrun``,
    ``mpirun``): when the job outlives ``timeout`` seconds, it and every rank it started are ended
    (:func:`kill_tree`) and ``subprocess.TimeoutExpired`` is raised with what it printed."""
    proc = subprocess.Popen(list(cmd), env=None if env is None else dict(env), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        stdout, stderr = proc.communicate()
        raise subprocess.TimeoutExpired(list(cmd), timeout, output=stdout, stderr=stderr) from None
    except BaseException:   # an interrupt: the job goes with it
        kill_tree(proc.pid)
        proc.wait()
        raise
    return subprocess.CompletedProcess(list(cmd), proc.returncode, stdout, stderr)
