"""deepreduce.collective.inflight: routes, a step's encode tasks on the worker, their finishing order,
error labels and timing (framework-free; the Horovod optimizer's tests cover it through torch)."""
import threading
import time

import pytest

from deepreduce.collective import inflight


class Routed:
    """A protocol whose route is fixed (what ReductionProtocol.route gives under a config)."""

    def __init__(self, route):
        self.chosen = route
        self.ended = []

    def route(self, name):
        return self.chosen

    def end_step(self, step, errors, order):
        self.ended.append((step, list(errors), order))


class Handle:
    def __init__(self):
        self.waited = False

    def wait(self):
        self.waited = True


@pytest.mark.parametrize("protocol, sparse, summed_dense, expected", [
    (None, False, False, "summable"), (None, True, True, "summable"),
    (Routed("allgather"), True, True, "entries"), (Routed("allgather"), False, True, "dense"),
    (Routed("fp16"), False, False, "fp16"), (Routed("sparse_allreduce"), False, False, "sparse_allreduce"),
])
def test_route_of(protocol, sparse, summed_dense, expected):
    assert inflight.route_of(protocol, "w", sparse, summed_dense) == expected


@pytest.mark.parametrize("background", [True, False])
def test_tasks_run_on_the_worker_or_inline(background):
    flight, threads = inflight.InFlight(background), []
    for key in "abc":
        flight.start(key, lambda: (threads.append(threading.current_thread().name), ("h", "allgather", None))[1],
                     f"tensor {key}", 0)
    assert flight.finish(lambda *args: None, 0.0) == [] and not flight.pending
    if background:
        assert threads and all(name.startswith("deepreduce-encode") for name in threads)
    else:
        assert threads == [threading.current_thread().name] * 3
        assert flight.stats()["encode_hidden_seconds"] == 0.0
    stats = flight.stats()
    assert stats["background"] is background and stats["encode_seconds"] >= 0.0


def test_sparse_allreduce_finishes_last_in_name_order():
    flight, finished = inflight.InFlight(False), []
    for key, route in [("z", "sparse_allreduce"), ("b", "allgather"), ("a", "sparse_allreduce"), ("c", "dense")]:
        flight.start(key, lambda key=key, route=route: ((key, 0), route, None), key, 3)
    assert flight.finish(lambda key, handle, route, data: finished.append(key), 0.0) == []
    assert finished == ["b", "c", "a", "z"]


def test_errors_are_labelled_and_raised_only_after_every_collective():
    flight, finished, failed_handle = inflight.InFlight(True), [], Handle()
    raised, failure = ValueError("encode broke"), KeyError("peer")

    def broken():
        raise raised

    flight.start("x", broken, "parameter 'x'", 7)
    flight.start("y", lambda: (failed_handle, "failed", failure), "parameter 'y'", 7)
    flight.start("z", lambda: (Handle(), "allgather", 7), "parameter 'z'", 7)
    errors = flight.finish(lambda key, handle, route, data: finished.append(key), 0.0)
    assert errors == [raised, failure] and finished == ["z"] and failed_handle.waited
    assert "deepreduce: raised while encoding parameter 'x' at step 7" in raised.__notes__


def test_timed_adds_the_block_seconds_also_when_it_raises():
    """The time was spent either way (dist.totals.timed, the DDP hook's rule too)."""
    flight = inflight.InFlight(False)
    with flight.timed("decode"):
        time.sleep(0.01)
    spent = flight.seconds["decode"]
    assert spent >= 0.01
    with pytest.raises(RuntimeError), flight.timed("decode"):
        time.sleep(0.01)
        raise RuntimeError("the time until it raised is counted")
    assert flight.seconds["decode"] >= spent + 0.01


def test_end_step_goes_through_the_protocol_or_raises_the_first_error():
    protocol, first = Routed("allgather"), ValueError("first")
    inflight.end_step(protocol, 4, [first], ["w"])
    assert protocol.ended == [(4, [first], ["w"])]
    inflight.end_step(None, 4, [])
    with pytest.raises(ValueError) as caught:
        inflight.end_step(None, 4, [first, KeyError("second")])
    assert caught.value is first
