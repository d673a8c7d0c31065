"""One gloo rank checking what a DDP hook state accepts from a checkpoint or a pickle (issue 34, item 3).

``run(rank, world, port, queue)`` puts ``(rank, results)`` on the queue: per case, ``"loaded"``
or the refusal's ``(error class, message)``, plus the step the state holds afterwards;
tests/test_hostile_round3_state.py checks them. No DDP model is needed: the state is built over
the process group and fed its own (altered) ``state_dict`` and ``__getstate__`` output.
"""
import copy
import os
import pickle
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_ddp_hook as hook  # noqa: E402

from deepreduce.errors import DeepReduceError  # noqa: E402
from deepreduce.torch import ddp  # noqa: E402

SPARSE = "topk_sparse_allreduce"


def _outcome(action):
    try:
        action()
    except DeepReduceError as exc:
        return type(exc).__name__, str(exc)
    return "loaded"


def _altered(state: dict, path, value) -> dict:
    out = copy.deepcopy(state)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


def scenario_checkpoint_fields(rank):
    state = ddp.DeepReduceState(None, hook.STATEFUL)
    state.step = 7
    saved = state.state_dict()
    sidco = ["compression", "sparsifier", "tensors"]
    saved["compression"]["sparsifier"]["tensors"]["fc"] = {"stages": 2, "acc": 10, "cnt": 1, "direction": 1,
                                                          "last_error": float("inf")}
    cases = {
        "step_2_70": (["step"], 2**70), "step_negative": (["step"], -1), "step_text": (["step"], "7"),
        "stats_negative": (["stats", "buckets"], -3), "stats_nan": (["stats", "encode_seconds"], float("nan")),
        "stats_text": (["stats", "wire_bytes"], "many"), "sidco_stages": (sidco + ["fc", "stages"], 10**9),
        "sidco_direction": (sidco + ["fc", "direction"], 5),
    }
    out = {}
    for case, (path, value) in cases.items():
        out[case] = _outcome(lambda: state.load_state_dict(_altered(saved, path, value)))
        out[case + "_step_after"] = state.step
    out["valid"] = _outcome(lambda: state.load_state_dict(saved))
    out["valid_step_after"] = state.step
    return out


def scenario_pickled_state(rank):
    state = ddp.DeepReduceState(None, hook.STATEFUL)
    out = {"valid": _outcome(lambda: pickle.loads(pickle.dumps(state)))}
    for case, attribute, value in (("step_2_70", "step", 2**70), ("step_float", "step", 1.5)):
        broken = ddp.DeepReduceState(None, hook.STATEFUL)
        setattr(broken, attribute, value)
        out[case] = _outcome(lambda: pickle.loads(pickle.dumps(broken)))
    broken = ddp.DeepReduceState(None, hook.STATEFUL)
    broken.stats["buckets"] = float("inf")
    out["stats_inf"] = _outcome(lambda: pickle.loads(pickle.dumps(broken)))
    return out


def scenario_sparse_allreduce_state(rank):
    state = ddp.DeepReduceState(None, SPARSE)
    saved = state.state_dict()
    saved["aggregation"] = {"owner_residuals": {"w": torch.zeros(10)},
                            "bounds": {"w": torch.tensor([0, 10])}}
    out = {"valid": _outcome(lambda: state.load_state_dict(saved))}
    for case, part, value in (("bounds_past_residual", "bounds", torch.tensor([0, 11])),
                              ("bounds_falling", "bounds", torch.tensor([5, 0])),
                              ("residual_nan", "owner_residuals", torch.full((10,), float("nan"))),
                              ("residual_2d", "owner_residuals", torch.zeros(2, 5))):
        out[case] = _outcome(lambda: state.load_state_dict(_altered(saved, ["aggregation", part, "w"], value)))
    pickled = state.__getstate__()
    pickled["_sparse_state"] = {"owner_residuals": {"w": np.zeros(4, np.float32)},
                                "bounds": {"w": np.array([0, 9])}}
    out["pickled_bad_bounds"] = _outcome(lambda: ddp.DeepReduceState.__new__(ddp.DeepReduceState).__setstate__(pickled))
    return out


SCENARIOS = [scenario_checkpoint_fields, scenario_pickled_state, scenario_sparse_allreduce_state]


def run(rank, world, port, queue):
    hook.run_scenarios(rank, world, port, queue, SCENARIOS, 200)
