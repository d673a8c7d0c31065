"""deepreduce.collective.step: the step engine in one process, with stand-in routes (what was
InFlight's: the worker or inline, the canonical finishing order, error labels, timing), and the
plan's route choice. The real routes run on real ranks in test_multirank.py (Horovod),
test_tensorflow_protocol.py (TF) and test_protocol.py (the NumPy port over a stand-in)."""
import threading

import numpy as np
import pytest

import deepreduce
from deepreduce.collective.ports import NumpyTensors
from deepreduce.collective.routes import Outcome, Route
from deepreduce.collective.step import Item, StepEngine
from deepreduce.errors import CommunicationError

CONFIG = {"sparsifier": {"id": "topk", "ratio": 0.5}, "index": "raw", "value": "raw", "memory": "residual",
          "min_numel": 0}


class Alone:
    rank, size = 0, 1

    def allgather(self, payload, name):
        return [payload]


class Recording(Route):
    """A route that records where and in which order its phases ran."""

    def __init__(self, rid, order, log):
        self.id, self.ORDER, self.log = rid, order, log

    def start(self, engine, item):
        self.log.append(("start", item.name, threading.current_thread().name))
        if item.name.startswith("broken"):
            raise ValueError("encode broke")
        return item.name

    def fail(self, engine, item, error):
        self.log.append(("fail", item.name, type(error).__name__))
        return "failure payload"

    def settle(self, engine, item, started):
        self.log.append(("settle", item.name))
        return started

    def settle_all(self, engine, items):
        self.log.append(("settle_all", self.id, [it.name for it in items]))

    def finish(self, engine, item, started):
        self.log.append(("finish", item.name))
        if started == "failure payload":
            raise CommunicationError("a rank could not encode")
        if item.name == "peer_failed":
            raise KeyError("peer")
        return Outcome(lambda divisor: self.log.append(("write", item.name, divisor)))


def engine_with(log, background, average=False, routes=("allgather", "sparse_allreduce")):
    engine = StepEngine(deepreduce.build(CONFIG), Alone(), NumpyTensors(), None, average=average,
                        background=background)
    for rid in routes:
        engine.routes[rid] = Recording(rid, 1 if rid == "sparse_allreduce" else 0, log)
    return engine


@pytest.mark.parametrize("background", [True, False])
def test_starts_run_on_the_worker_or_inline_and_finish_in_one_order(background, monkeypatch):
    log = []
    engine = engine_with(log, background)
    routes = {"z": "sparse_allreduce", "b": "allgather", "a": "sparse_allreduce", "c": "allgather"}
    monkeypatch.setattr(engine.protocol, "route", routes.__getitem__)
    for name in "zbac":
        engine.submit(Item(name, 3, np.zeros(4, np.float32)))
    engine.finish(3, list("abcz"))
    threads = {entry[2] for entry in log if entry[0] == "start"}
    assert threads == ({"deepreduce-step_0"} if background else {threading.current_thread().name})
    # every settle before any finish; the routes matched by name first, then the sparse all-reduce, by name
    assert [e[1] for e in log if e[0] == "settle"] == ["b", "c", "a", "z"]
    # then each route once with its items (the sparse all-reduce's one shared exchange), before any finish
    first_finish = log.index(("finish", "b"))
    assert [e for e in log[:first_finish] if e[0] == "settle_all"] == [
        ("settle_all", "allgather", ["b", "c"]), ("settle_all", "sparse_allreduce", ["a", "z"])]
    assert [e[1] for e in log if e[0] == "finish"] == ["b", "c", "a", "z"]
    assert [e for e in log if e[0] == "write"] == [("write", n, 1) for n in "bcaz"]
    stats = engine.stats()
    assert stats["background"] is background and stats["steps"] == 1
    assert stats["routes_taken"] == {"allgather": 2, "sparse_allreduce": 2}
    if not background:
        assert stats["encode_hidden_seconds"] == 0.0
    engine.close()


def test_an_encode_error_sends_the_failure_and_is_raised_after_every_collective(monkeypatch):
    log = []
    engine = engine_with(log, True)
    monkeypatch.setattr(engine.protocol, "route", lambda name: "allgather")
    for name in ("broken", "peer_failed", "fine"):
        engine.submit(Item(name, 7, np.zeros(4, np.float32), label=f"parameter {name!r}"))
    with pytest.raises(ValueError) as caught:
        engine.finish(7, ["broken", "peer_failed", "fine"])
    assert ("fail", "broken", "ValueError") in log   # its failure payload went in its place
    assert [e[1] for e in log if e[0] == "finish"] == ["broken", "fine", "peer_failed"]   # every one drained
    assert [e[1] for e in log if e[0] == "write"] == ["fine"]
    assert "deepreduce: raised while encoding parameter 'broken' at step 7" in caught.value.__notes__
    assert engine.stats()["steps"] == 0   # the step was not applied
    engine.close()


def test_the_engine_divides_once_when_averaging(monkeypatch):
    log = []
    engine = engine_with(log, False, average=True)
    monkeypatch.setattr(engine.protocol, "route", lambda name: "allgather")
    engine.submit(Item("w", 0, np.zeros(4, np.float32)))
    engine.finish(0)
    assert ("write", "w", 1) in log   # Alone: one rank, so the divisor is 1


@pytest.mark.parametrize("compressor, sparse, summed_dense, chosen, expected", [
    (object(), False, False, "allgather", "summable"), (None, False, True, "allgather", "dense"),
    (None, False, False, "fp16", "fp16"), (None, False, False, "sparse_allreduce", "sparse_allreduce"),
])
def test_the_plan_picks_the_route(compressor, sparse, summed_dense, chosen, expected, monkeypatch):
    engine = StepEngine(None if compressor else deepreduce.build(CONFIG), Alone(), NumpyTensors(), None,
                        compressor=compressor, background=False)
    if engine.protocol is not None:
        monkeypatch.setattr(engine.protocol, "route", lambda name: chosen)
    item = Item("w", 0, np.zeros(4, np.float32), summed_dense=summed_dense)
    assert engine._route_of(item) == expected


class Ended:
    """A protocol that records its end_step calls."""

    def __init__(self):
        self.ended = []

    def end_step(self, step, errors, order):
        self.ended.append((step, list(errors), order))


def test_the_end_of_a_step_goes_through_the_protocol_or_raises_the_first_error():
    """What the DDP hook's end of a step did (inflight.end_step), now the engine's for every binding;
    an error every rank raised at one collective loses the frames that differ between routes."""
    from deepreduce.collective import failure

    engine, first = engine_with([], False), ValueError("first")
    engine.protocol = Ended()
    engine._end(4, [first], ["w"])
    assert engine.protocol.ended == [(4, [first], ["w"])]
    engine.protocol = None
    engine._end(4, [], [])
    with pytest.raises(ValueError) as caught:
        engine._end(4, [first, KeyError("second")], [])
    assert caught.value is first
    try:
        raise failure.everywhere(CommunicationError("layouts differ"))
    except CommunicationError as exc:
        everywhere = exc
    with pytest.raises(CommunicationError) as caught:
        engine._end(5, [everywhere], [])
    assert caught.value is everywhere and caught.traceback[-1].name == "_end"
    assert engine.stats()["steps"] == 2   # the two steps that raised nothing
