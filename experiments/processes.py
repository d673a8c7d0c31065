"""Launching multi-rank jobs without leaving ranks behind.

``horovodrun`` starts ``mpirun`` in a session of its own and ``mpirun`` puts each rank in a process
group of its own, so ending the launcher, its process group or its session leaves the ranks
running: on a shared machine they keep spinning on the cores (and holding their ports) through
whatever runs next. :func:`kill_tree` ends the whole job; :func:`run_job` runs a launcher and
calls it when the job outlives its timeout. :func:`rendezvous_port` picks rank 0's port outside
the range the kernel hands out to other sockets meanwhile.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from typing import Mapping, Optional, Sequence

#: Ports below this are never the kernel's ephemeral ports (Linux's default range starts at 32768).
FALLBACK_EPHEMERAL_LOW = 32768
#: The lowest port :func:`rendezvous_port` tries.
LOWEST_PORT = 10000


def rendezvous_port() -> int:
    """A TCP port free on loopback now, for rank 0's rendezvous (``MASTER_PORT``), chosen below the
    kernel's ephemeral range. Between choosing it and rank 0 binding it (seconds: the ranks start
    and import torch first), a port from that range can be handed to another socket: binding port
    0 (what gloo's listeners do) may reissue it, and a connection's source port may be it (on
    loopback, a connection to a port nobody listens on yet can connect to itself: seen here for
    even ports, which Linux prefers for connections). Either leaves rank 0 unable to bind
    ("address already in use") while the other ranks wait for it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = FALLBACK_EPHEMERAL_LOW
    below = range(LOWEST_PORT, max(ephemeral_low, LOWEST_PORT))
    for port in random.Random(os.getpid() ^ time.monotonic_ns()).sample(below, min(50, len(below))):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:   # taken
                continue
            return port
    with socket.socket() as sock:   # every candidate taken: the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
