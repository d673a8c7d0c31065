"""What the engine policy workers (torch_engine_policies.py, torch_ddp_engine_policies.py and, for
the aggregations, tf_engine_policies.py) check alike: the scenarios' aggregations, the parameters
as one vector, every residual a step may touch, and equality of nested state."""
import copy

import numpy as np
import torch


def aggregation(route):
    """The config's aggregation section of a scenario's route: the sparse all-reduce with every
    exchange after backward, or with its large tensors' started during backward (``early_numel``:
    the weights go early, the biases share the batch after backward)."""
    if route == "sparse_allreduce":
        return {"aggregation": {"id": "sparse_allreduce", "early_numel": 2**62}}
    if route == "sparse_allreduce_early":
        return {"aggregation": {"id": "sparse_allreduce", "early_numel": 100}}
    return {}


def route_id(route):
    """The engine's route a scenario runs on."""
    return "sparse_allreduce" if route == "sparse_allreduce_early" else route


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def residuals(pipeline, protocol):
    """Copies of every error-feedback residual (per-rank, and the sparse all-reduce's owner ones)."""
    if pipeline is None:
        return {}
    kept = {k: copy.deepcopy(v) for k, v in pipeline.core.memory.state_dict().get("residuals", {}).items()}
    sparse = None if protocol is None else protocol.sparse
    if sparse is not None:
        kept.update({f"owner.{k}": v for k, v in sparse.state_dict()["owner_residuals"].items()})
    return kept


def equal(a, b):
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return np.array_equal(np.asarray(a), np.asarray(b))
