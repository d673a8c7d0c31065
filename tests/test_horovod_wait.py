"""The Horovod transport waits for a collective without spinning (``comm.horovod.settled``):
Horovod's own ``synchronize`` loops on ``sched_yield``, so every millisecond a rank waits for its
peers would count as a millisecond of its CPU. Checked against a stand-in for ``horovod.torch``
(the real collectives run in the multi-rank tests: test_sparse_allreduce.py, test_multirank.py)."""
import time

from deepreduce.collective.comm import horovod as comm


class FakeHorovod:
    """``poll`` is False until ``ready_after`` seconds have passed; ``synchronize`` counts calls."""

    def __init__(self, ready_after: float) -> None:
        self.ready_at = time.perf_counter() + ready_after
        self.polls = 0
        self.synchronized = 0

    def poll(self, handle) -> bool:
        self.polls += 1
        return time.perf_counter() >= self.ready_at

    def synchronize(self, handle):
        assert time.perf_counter() >= self.ready_at, "synchronize before the collective finished"
        self.synchronized += 1
        return ("result", handle)


def test_a_finished_collective_is_returned_at_once():
    hvd = FakeHorovod(0.0)
    assert comm.settled(hvd, 7) == ("result", 7)
    assert hvd.polls == 1 and hvd.synchronized == 1


def test_a_pending_collective_is_polled_with_growing_sleeps_not_spun_on():
    hvd = FakeHorovod(0.05)
    wall, cpu = time.perf_counter(), time.process_time()
    assert comm.settled(hvd, 3) == ("result", 3)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert hvd.synchronized == 1
    # sleeps double from 20 us to 0.2 ms: about 250 polls for a 50 ms wait (fewer on a busy
    # machine, whose sleeps overrun), never one poll per 20 us
    assert 2 <= hvd.polls < 50e-3 / comm.FIRST_SLEEP_S
    assert cpu < 0.5 * wall   # the wait left the core alone
