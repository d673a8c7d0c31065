"""deepreduce.collective.inflight.end_step (the DDP hook's end of a step) and
deepreduce.collective.totals.timed. The step's tasks, order, error labels and timing moved to the
step engine: test_step_engine.py."""
import time

import pytest

from deepreduce.collective import inflight, totals


class Routed:
    """A protocol that records its end_step calls."""

    def __init__(self):
        self.ended = []

    def end_step(self, step, errors, order):
        self.ended.append((step, list(errors), order))


def test_timed_adds_the_block_seconds_also_when_it_raises():
    """The time was spent either way (the engine's and the DDP hook's rule)."""
    seconds = {"decode": 0.0}
    with totals.timed(seconds, "decode"):
        time.sleep(0.01)
    spent = seconds["decode"]
    assert spent >= 0.01
    with pytest.raises(RuntimeError), totals.timed(seconds, "decode"):
        time.sleep(0.01)
        raise RuntimeError("the time until it raised is counted")
    assert seconds["decode"] >= spent + 0.01


def test_end_step_goes_through_the_protocol_or_raises_the_first_error():
    protocol, first = Routed(), ValueError("first")
    inflight.end_step(protocol, 4, [first], ["w"])
    assert protocol.ended == [(4, [first], ["w"])]
    inflight.end_step(None, 4, [])
    with pytest.raises(ValueError) as caught:
        inflight.end_step(None, 4, [first, KeyError("second")])
    assert caught.value is first
