"""What the engine policy workers (torch_engine_policies.py, torch_ddp_engine_policies.py) check
alike: the parameters as one vector, every residual a step may touch, and equality of nested state."""
import copy

import numpy as np
import torch


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
