"""deepreduce.collective.totals.timed. The end of a step (once inflight.end_step, now the step
engine's for every binding) is tested in test_step_engine.py."""
import time

import pytest

from deepreduce.collective import totals


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
