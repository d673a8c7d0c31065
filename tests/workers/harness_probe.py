"""Ranks that misbehave on purpose, for tests/test_spawn_harness.py: the launcher of the
multi-process tests (conftest.spawn_ranks) must turn each into a prompt, readable failure."""
import os
import sys
import time


def run_ok(rank, world, port, queue):
    print(f"rank {rank} of {world} says hello")
    queue.put((rank, {"rank": rank, "port": port}))


def run_one_rank_dies(rank, world, port, queue):
    """Rank 1 exits with code 3 before reporting; rank 0 waits forever for it."""
    if rank == 1:
        print("rank 1 gives up", file=sys.stderr, flush=True)
        os._exit(3)
    while True:
        time.sleep(0.1)


def wait_for_a_peer_that_never_comes():
    while True:
        time.sleep(0.1)


def run_hang(rank, world, port, queue):
    wait_for_a_peer_that_never_comes()
