"""deepreduce.collective.agreement in one process: layouts, the two-round exchange between threads standing in
for ranks, the non-finite flag, and undoing a skipped step. The real 2-rank runs are in
test_multirank.py, test_torch_ddp.py and test_tensorflow_distributed.py."""
import threading

import numpy as np
import pytest
from conftest import run_threads

import deepreduce
from deepreduce.collective import agreement
from deepreduce.errors import CommunicationError
from deepreduce.summable.gradiveq import Settings

TOPK = {"sparsifier": {"id": "topk", "ratio": 0.05}, "index": "raw", "value": "raw", "memory": "residual",
        "min_numel": 10}
BASE = [("fc1.weight", (64, 20), "float32"), ("fc1.bias", (64,), "float32"), ("fc2.weight", (10, 64), "float32")]


def layout(tensors=BASE, compression=None):
    compression = deepreduce.build(TOPK) if compression is None else compression
    return agreement.Layout(agreement.compressor_identity(compression), tensors, "parameter")


def exchange(layouts):
    """Run agree() on one thread per rank over an in-memory allgather; each rank's error text (or None)."""
    barrier, slots, errors = threading.Barrier(len(layouts)), [None] * len(layouts), [None] * len(layouts)

    def allgather_of(rank):
        def allgather(payload):
            slots[rank] = payload
            barrier.wait()
            gathered = list(slots)
            barrier.wait()
            return gathered
        return allgather

    def run(rank):
        try:
            agreement.agree(layouts[rank], allgather_of(rank), "test")
        except CommunicationError as exc:
            errors[rank] = str(exc)

    run_threads(run, [(r,) for r in range(len(layouts))], 10, "the exchange hung")
    return errors


def test_equal_layouts_agree_in_one_round():
    assert exchange([layout(), layout()]) == [None, None]


@pytest.mark.parametrize("other, expected", [
    (BASE + [("fc3.weight", (5, 10), "float32")],
     "rank 1 has parameter 'fc3.weight' (5, 10) float32 that rank 0 lacks (rank 0 has 3 parameters, rank 1 has 4)"),
    (BASE[:1] + BASE[2:], "rank 0 has parameter 'fc1.bias' (64,) float32 that rank 1 lacks"),
    (BASE[:2] + [("fc2.weight", (10, 65), "float32")],
     "parameter 'fc2.weight' is (10, 64) float32 on rank 0 and (10, 65) float32 on rank 1"),
    (BASE[:2] + [("fc2.weight", (10, 64), "float64")], "(10, 64) float32 on rank 0 and (10, 64) float64 on rank 1"),
    ([BASE[1], BASE[0], BASE[2]], "position 0 holds 'fc1.weight' on rank 0 and 'fc1.bias' on rank 1"),
])
def test_every_rank_names_the_same_first_difference(other, expected):
    errors = exchange([layout(), layout(other)])
    assert errors[0] == errors[1] and expected in errors[0]


def test_compressors_are_named_when_they_differ():
    errors = exchange([layout(), layout(compression=Settings()), layout()])
    assert errors[0] == errors[1] == errors[2]
    assert "rank 0 uses deepreduce config (sparsifier topk, index raw, value raw, memory residual" in errors[0]
    assert "rank 1 uses GradiVeQ(" in errors[0]


def test_config_identity_is_the_container_digest():
    pipe = deepreduce.build(TOPK)
    label, digest = agreement.compressor_identity(pipe)
    payload = pipe.encode(np.ones(100, np.float32), name="w")
    assert digest == deepreduce.inspect(payload)["config_digest"]
    assert agreement.compressor_identity(deepreduce.build(TOPK)) == (label, digest)
    assert agreement.compressor_identity(deepreduce.build(dict(TOPK, min_numel=11)))[1] != digest


def test_unreadable_description_is_a_message_not_a_crash():
    good = layout()

    def allgather(payload):
        return [payload, agreement.wrap_bytes(b"{not json")]

    assert "rank 1 sent an unreadable description" in agreement.explain(good, allgather)


def raising_pipeline(config=TOPK):
    pipe = deepreduce.build(dict(config, nonfinite="raise"))
    pipe.collective_steps()
    return pipe


def test_collective_raise_mode_sends_the_flagged_container():
    pipe = raising_pipeline()
    g = np.ones(100, np.float32)
    ok = pipe.encode(g, name="w", step=0)
    g[[3, 5]], g[7] = np.nan, np.inf
    bad = pipe.encode(g, name="w", step=1)
    assert agreement.first_nonfinite([ok, ok]) is None
    assert agreement.first_nonfinite([ok, bad, bad]) == (1, 2, 1)
    message = str(agreement.nonfinite_error("w", 1, 1, 2, 1, more=3))
    assert "'w' at step 1 has 2 NaN and 1 Inf entries on rank 1 (and 3 more" in message


def test_undo_restores_residuals_and_learned_state_exactly():
    config = {"sparsifier": {"id": "sidco", "ratio": 0.05, "stages": 2, "period": 1}, "index": "raw",
              "value": "raw", "memory": "residual", "min_numel": 10}
    pipe = raising_pipeline(config)
    rng = np.random.default_rng(0)
    pipe.encode(rng.standard_normal(500).astype(np.float32), name="w", step=0)
    pipe.commit_step()
    before = pipe.state_dict()
    pipe.encode(rng.standard_normal(500).astype(np.float32), name="w", step=1)
    pipe.encode(rng.standard_normal(300).astype(np.float32), name="v", step=1)
    assert not np.array_equal(pipe.memory.residual("w"), before["memory"]["residuals"]["w"])
    assert pipe.state_dict()["sparsifier"] != before["sparsifier"]
    pipe.undo_step()
    after = pipe.state_dict()
    assert set(after["memory"]["residuals"]) == {"w"}
    np.testing.assert_array_equal(after["memory"]["residuals"]["w"], before["memory"]["residuals"]["w"])
    assert after["sparsifier"] == before["sparsifier"]


def test_without_collective_steps_raise_mode_still_raises_locally():
    pipe = deepreduce.build(dict(TOPK, nonfinite="raise"))
    with pytest.raises(deepreduce.NonFiniteGradientError):
        pipe.encode(np.full(100, np.nan, np.float32), name="w")


def test_the_torch_device_path_flags_and_undoes_too():
    """Torch tensors go through the core's array-namespace path (on their device): the same flag
    and the same exact undo of a torch residual."""
    torch = pytest.importorskip("torch")
    pipe = raising_pipeline()
    ok = pipe.encode(torch.ones(100), name="w", step=0)
    pipe.commit_step()
    before = pipe.memory.residual("w").clone()
    pipe.encode(torch.full((100,), 2.0), name="w", step=1)
    bad = torch.ones(100)
    bad[3] = float("nan")
    flagged = pipe.encode(bad, name="v", step=1)
    assert agreement.first_nonfinite([ok, flagged]) == (1, 1, 0)
    pipe.undo_step()
    assert torch.equal(pipe.memory.residual("w"), before) and pipe.memory.residual("v") is None


def test_layout_of_enters_buckets_as_tensors_so_different_bucket_plans_fail_together():
    pipe = deepreduce.build(TOPK)
    made = agreement.layout_of(pipe, BASE, [("bucket0.fc2.weight", 1344)], "parameter")
    assert made.digest == layout(BASE + [("<bucket0.fc2.weight>", (1344,), "bucket")], pipe).digest
    other = agreement.layout_of(pipe, BASE, [("bucket0.fc2.weight", 640)], "parameter")
    errors = exchange([made, other])
    assert errors[0] == errors[1] and "'<bucket0.fc2.weight>' is (1344,) bucket on rank 0 and (640,) bucket" in errors[0]
