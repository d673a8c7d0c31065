"""Two gloo ranks (torch.multiprocessing spawn) exercising the DDP hook; one launch runs every scenario.

``run(rank, world, port, queue)`` puts ``(rank, results)`` on the queue, results keyed by scenario;
tests/test_torch_ddp.py checks them. Scenarios that must fail run last, each on a fresh model.
"""
import contextlib
import copy
import io
import os
import pickle
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import watchdog  # noqa: E402

from deepreduce.torch import GradiVeQ, ddp  # noqa: E402
from deepreduce.wire import container

TOPK = {"sparsifier": {"id": "topk", "ratio": 0.01}, "index": "raw", "value": "raw", "memory": "residual"}
LOSSLESS = {"sparsifier": "none", "index": "raw", "value": "raw", "memory": "none"}
STATEFUL = {"sparsifier": {"id": "sidco", "ratio": 0.02, "stages": 2, "period": 2}, "memory": "residual",
            "index": {"id": "bloom", "policy": "p2", "fpr": 0.01}, "value": "raw"}


class Net(nn.Module):
    """Conv + linear layers above and below the 1,000-element dense threshold; optional extra branch."""

    def __init__(self, branch: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3)
        self.fc1 = nn.Linear(16 * 6 * 6, 64)
        self.fc2 = nn.Linear(64, 10)
        self.branch = nn.Linear(16 * 6 * 6, 10) if branch else None
        self.unused = nn.Linear(10, 10) if branch else None

    def forward(self, x, use_branch: bool = False):
        h = torch.relu(self.conv(x)).flatten(1)
        out = self.fc2(torch.relu(self.fc1(h)))
        return out + self.branch(h) if use_branch else out


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)


def make(compression="default", seed=0, branch=False, path="auto", per_parameter=True, bucket_cap_mb=0.02,
         **ddp_kwargs):
    """(ddp model, optimizer, hook state or None) from one seed; the default bucket cap is small
    enough for 2+ buckets."""
    torch.manual_seed(seed)
    net = Net(branch)
    model = DDP(net, bucket_cap_mb=bucket_cap_mb, **ddp_kwargs)
    state = None if compression == "default" else ddp.register(model, compression, path=path,
                                                               per_parameter=per_parameter)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), state


def train(model, opt, rank, steps, start=0, use_branch=False):
    for step in range(start, start + steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x, use_branch), y).backward()
        opt.step()


def flat_params(model) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def record_containers(pipeline) -> dict:
    """Wrap a TorchPipeline's encode so every container it sends is kept, by parameter name."""
    sent = {}
    encode = pipeline.encode

    def recording(tensor, name="", step=0):
        payload = encode(tensor, name=name, step=step)
        sent[name] = payload.numpy().tobytes()
        return payload

    pipeline.encode = recording
    return sent


def error_of(fn):
    start = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # the scenario reports what was raised
        return type(exc).__name__, str(exc), time.perf_counter() - start
    return None, "", time.perf_counter() - start


def scenario_lossless(rank):
    reference, ref_opt, _ = make()
    hooked, opt, _ = make(LOSSLESS, gradient_as_bucket_view=True)
    train(reference, ref_opt, rank, 3)
    train(hooked, opt, rank, 3)
    fp16, fp16_opt, _ = make(ddp.FP16Compressor())
    train(fp16, fp16_opt, rank, 3)
    ref = flat_params(reference)
    return {"max_diff": float(np.abs(flat_params(hooked) - ref).max()), "params": flat_params(hooked),
            "fp16_max_diff": float(np.abs(flat_params(fp16) - ref).max())}


def scenario_sparse_allreduce(rank):
    """``aggregation: sparse_allreduce`` without re-selection (the exact union) against DDP's own
    all-reduce, per parameter and in whole buckets, the step's tensors sharing one alltoall per
    phase (``all_to_all_single`` calls per step: two per alltoall, its sizes then its bytes);
    Top-r with re-selection resumes from the state dict (owner residuals included) like the
    uninterrupted run."""
    reference, ref_opt, _ = make()
    train(reference, ref_opt, rank, 3)
    exact = dict(LOSSLESS, sparsifier={"id": "topk", "ratio": 1.0}, min_numel=0,
                 aggregation={"id": "sparse_allreduce", "reselect": "none"})
    diffs, alltoalls = [], []
    for per_parameter in (True, False):
        model, opt, state = make(exact, per_parameter=per_parameter)
        counter = [0]
        restore = count_collectives(state._group, counter, ("all_to_all_single",))
        try:
            for step in range(3):
                before = counter[0]
                train(model, opt, rank, 1, start=step)
                alltoalls.append(counter[0] - before)
        finally:
            restore()
        diffs.append(float(np.abs(flat_params(model) - flat_params(reference)).max()))
    topk = dict(TOPK, aggregation={"id": "sparse_allreduce", "repartition_every": 2})
    straight, opt, _ = make(topk)
    train(straight, opt, rank, 4)
    first, opt, state = make(topk)
    train(first, opt, rank, 2)
    saved = (copy.deepcopy(first.module.state_dict()), copy.deepcopy(opt.state_dict()), state.state_dict())
    resumed, opt2, state2 = make(topk)
    resumed.module.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    state2.load_state_dict(saved[2])
    train(resumed, opt2, rank, 2, start=2)
    return {"max_diffs": diffs, "alltoalls_per_step": alltoalls,
            "resumed_equal": bool(np.array_equal(flat_params(straight), flat_params(resumed))),
            "has_owner_state": "aggregation" in saved[2]}


COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all_single", "broadcast",
               "all_gather_object", "reduce_scatter", "gather", "scatter")


def count_collectives(group, counter: list, names=COLLECTIVES):
    """Wrap torch.distributed's collectives (``names``) so each call on ``group`` adds one to
    ``counter[0]``; returns a function that unwraps them."""
    originals = {name: getattr(dist, name) for name in names}

    def wrap(name, original):
        def counted(*args, **kwargs):
            if kwargs.get("group") is group:
                counter[0] += 1
            return original(*args, **kwargs)
        return counted

    for name, original in originals.items():
        setattr(dist, name, wrap(name, original))
    return lambda: [setattr(dist, name, original) for name, original in originals.items()]


def scenario_collectives(rank):
    """Collectives on the hook's private group per step against the buckets of that step
    (Top-r with raw codecs: container sizes that follow from the shapes)."""
    model, opt, state = make(TOPK)
    counter, per_step = [0], []
    restore = count_collectives(state._group, counter)
    try:
        for step in range(5):
            before, buckets = counter[0], state.stats["buckets"]
            train(model, opt, rank, 1, start=step)
            per_step.append((counter[0] - before, state.stats["buckets"] - buckets))
    finally:
        restore()
    return {"per_step": per_step, "params": flat_params(model)}


class FlakyFP16(ddp.FP16Compressor):
    """FP16Compressor whose compress of the tensor of ``numel`` elements raises the ``fail_at``-th
    time (from 0) it sees one; a count, not a flag the training loop sets, because the worker may
    still compress a step's other buckets after DDP's backward raised."""

    def __init__(self, numel: int, fail_at: int) -> None:
        self.numel, self.fail_at, self.seen = numel, fail_at, 0

    def compress(self, tensor):
        if tensor.numel() == self.numel:
            self.seen += 1
            if self.seen - 1 == self.fail_at:
                raise ValueError("fp16 boom")
        return super().compress(tensor)


def scenario_summable_collectives(rank):
    """A summable compressor: collectives on the hook's private group per step against the
    buckets of that step; rank 1's compress of fc1.weight raises at step 5 (in steady state), and
    the steps after it go on."""
    compressor = FlakyFP16(Net().fc1.weight.numel(), 5 if rank == 1 else -1)
    model, opt, state = make(compressor)
    counter, per_step, errors = [0], [], {}
    restore = count_collectives(state._group, counter)
    try:
        for step in range(8):
            before, buckets = counter[0], state.stats["buckets"]
            try:
                train(model, opt, rank, 1, start=step)
            except RuntimeError as exc:
                errors[step] = str(exc)
            state.wait_idle()   # DDP raises at the first failed bucket; the worker finishes the others
            per_step.append((counter[0] - before, state.stats["buckets"] - buckets))
    finally:
        restore()
    return {"per_step": per_step, "errors": errors, "params": flat_params(model)}


def scenario_auto(rank):
    """``aggregation: auto`` in the hook on a very fast and a very slow link: a plan per bucket
    after the second step (DDP's buckets are rebuilt after the first), printed once by rank 0,
    reported by compression_stats(); training goes on under it. The links are stated and the host
    costs off (``host_costs: false``), so the link decides. The fast link has no latency: with
    one, an allgather (N-1 messages) of a small bucket can rightly beat the ring's 2(N-1)."""
    results = {}
    for link, gbit, latency in (("fast", 1e5, 0.0), ("slow", 1e-3, 25.0)):
        model, opt, state = make(dict(TOPK, aggregation={"id": "auto", "bandwidth_gbit": gbit, "latency_us": latency,
                                                         "host_costs": False}))
        printed, losses = io.StringIO(), []
        with contextlib.redirect_stdout(printed):
            for step in range(8):
                x, y = batch(rank, step % 2)   # two batches seen again and again: the loss must fall
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                losses.append(float(loss))
        stats = state.compression_stats()
        results[link] = {"plan": stats["plan"], "plans_made": stats["plans_made"], "losses": losses,
                         "printed": printed.getvalue(), "params": flat_params(model),
                         "residuals_left": sum(int(np.count_nonzero(r)) for r in residuals(state).values())}
    return results


def scenario_gradiveq(rank):
    compressor = GradiVeQ(warmup=1, sample_iters=2, compress_iters=3, min_numel=64)
    model, opt, state = make(compressor)
    train(model, opt, rank, 5)
    return {"params": flat_params(model), "compressed": compressor.stats["compressed"],
            "wire_bytes": state.compression_stats()["wire_bytes"]}


def scenario_topk_bytes(rank):
    model, opt, state = make(TOPK)
    train(model, opt, rank, 3)
    stats = state.compression_stats()
    shapes = [tuple(p.shape) for p in model.module.parameters()]
    return {"wire_bytes": stats["wire_bytes"], "steps": stats["steps"], "shapes": shapes}


def scenario_device_path(rank):
    """The torch device path (codecs on torch tensors, decode into the bucket) against the host path."""
    runs = {}
    for path in ("host", "device"):
        model, opt, state = make(STATEFUL, path=path)
        sent = record_containers(state.pipeline)
        train(model, opt, rank, 3)
        runs[path] = (flat_params(model), dict(sent))
    return {"params_equal": bool(np.array_equal(runs["host"][0], runs["device"][0])),
            "containers_equal": runs["host"][1] == runs["device"][1], "params": runs["device"][0]}


def scenario_checkpoint(rank):
    steps = 3
    model, opt, state = make(STATEFUL)
    train(model, opt, rank, steps)
    buffer = io.BytesIO()
    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                "deepreduce": state.state_dict()}, buffer)
    original = record_containers(state.pipeline)
    train(model, opt, rank, 1, start=steps)

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed_model, resumed_opt, resumed_state = make(STATEFUL, seed=1)
    resumed_model.module.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    resumed_state.load_state_dict(checkpoint["deepreduce"])
    resumed = record_containers(resumed_state.pipeline)
    train(resumed_model, resumed_opt, rank, 1, start=steps)

    forgetful_model, forgetful_opt, forgetful_state = make(STATEFUL, seed=1)
    forgetful_model.module.load_state_dict(checkpoint["model"])
    forgetful_opt.load_state_dict(checkpoint["optimizer"])
    forgetful = record_containers(forgetful_state.pipeline)
    train(forgetful_model, forgetful_opt, rank, 1, start=steps)
    return {"names": sorted(original), "identical": original == resumed, "without_state_identical": original == forgetful,
            "params_equal": bool(np.array_equal(flat_params(model), flat_params(resumed_model))),
            "step": resumed_state.step}


def scenario_hook_pickling(rank):
    """PyTorch's PowerSGD pickling pattern: a state pickled after 2 steps, loaded and registered
    on a restored model with ``model.register_comm_hook(state, deepreduce_hook)``, no bind(). It
    names the parameters from the buckets, by the order it recorded, and trains on exactly as the
    state that was never pickled and as the loaded state bound with ``register(model, state=)``
    (same containers, names, residuals and seeds). A state pickled before its first bucket names
    them ``param.<k>``, as one built without named_parameters; a restored model of other shapes
    is a ConfigError on every rank, asking for bind()."""
    model, opt, state = make(STATEFUL)
    train(model, opt, rank, 2)
    pickled = pickle.dumps(state)
    saved = copy.deepcopy(model.module.state_dict()), copy.deepcopy(opt.state_dict())
    never_pickled = record_containers(state.pipeline)
    train(model, opt, rank, 2, start=2)

    def restore(bind: bool):
        net, net_opt, _ = make()
        net.module.load_state_dict(saved[0])
        net_opt.load_state_dict(copy.deepcopy(saved[1]))   # load_state_dict keeps the momentum tensors
        loaded = pickle.loads(pickled)
        if bind:
            ddp.register(net, state=loaded)
        else:
            net.register_comm_hook(loaded, ddp.deepreduce_hook)
        sent = record_containers(loaded.pipeline)
        train(net, net_opt, rank, 2, start=2)
        return flat_params(net), sent, loaded.step

    lazy, lazy_sent, lazy_step = restore(bind=False)
    bound, bound_sent, _ = restore(bind=True)

    def fresh(named: bool):
        net, net_opt, _ = make()
        names = Net().named_parameters() if named else None
        hook_state = ddp.DeepReduceState(compression=STATEFUL, named_parameters=names)
        if named:
            hook_state = pickle.loads(pickle.dumps(hook_state))
        net.register_comm_hook(hook_state, ddp.deepreduce_hook)
        sent = record_containers(hook_state.pipeline)
        train(net, net_opt, rank, 2)
        return flat_params(net), sorted(sent)

    fresh_pickled, fresh_names = fresh(named=True)
    unnamed, unnamed_names = fresh(named=False)

    other = DDP(nn.Linear(4, 3))
    other.register_comm_hook(pickle.loads(pickled), ddp.deepreduce_hook)
    mismatch = error_of(lambda: other(torch.randn(2, 4)).sum().backward())
    return {"params": flat_params(model), "lazy": lazy, "bound": bound, "lazy_step": lazy_step,
            "names": sorted(never_pickled), "lazy_identical": lazy_sent == never_pickled,
            "bound_identical": bound_sent == never_pickled, "fresh_pickled": fresh_pickled, "unnamed": unnamed,
            "fresh_names": fresh_names, "unnamed_names": unnamed_names, "mismatch": mismatch}


def scenario_warmup(rank):
    """``warmup: 2``: the containers of steps 0 and 1 are dense, those of step 2 sparse; a state
    resumed from a checkpoint taken after step 1 goes on sparse (the step counter is saved), a
    fresh state starts its own warm-up."""
    config = dict(TOPK, warmup=2)

    def dense_per_step(model, opt, state, start, steps):
        sent, out = record_containers(state.pipeline), []
        for step in range(start, start + steps):
            train(model, opt, rank, 1, start=step)
            state.wait_idle()
            out.append(all(container.unpack(np.frombuffer(data, dtype=np.uint8)).dense for data in sent.values()))
        return out

    model, opt, state = make(config)
    warm = dense_per_step(model, opt, state, 0, 2)
    checkpoint = state.state_dict()
    after = dense_per_step(model, opt, state, 2, 1)
    resumed_model, resumed_opt, resumed_state = make(config)
    resumed_state.load_state_dict(checkpoint)
    resumed = dense_per_step(resumed_model, resumed_opt, resumed_state, 2, 1)
    fresh = dense_per_step(*make(config), 2, 1)
    return {"warm": warm, "after": after, "resumed": resumed, "fresh": fresh}


def scenario_unused(rank):
    model, opt, state = make(TOPK, branch=True, find_unused_parameters=True)
    train(model, opt, rank, 3, use_branch=rank == 0)
    return {"params": flat_params(model), "steps": state.step}


def residuals(state):
    return {k: v.copy() for k, v in state.pipeline.core.memory.state_dict()["residuals"].items()}


def scenario_nonfinite(rank):
    model, opt, _ = make(TOPK)
    x, y = batch(rank, 0)
    if rank == 0:
        x[0, 0, 0, 0] = float("nan")
    nn.functional.cross_entropy(model(x), y).backward()
    all_nan = all(bool(torch.isnan(p.grad).all()) for p in model.parameters())
    # nonfinite: raise, rank 1's gradient is NaN at step 1: the skip-the-step loop of docs/ddp.md
    model, opt, state = make(dict(TOPK, nonfinite="raise"))
    skipped, unchanged = [], []
    for step in range(3):
        x, y = batch(rank, step)
        if step == 1 and rank == 1:
            x[0, 0, 0, 0] = float("nan")
        weights, kept = flat_params(model), residuals(state)
        opt.zero_grad()
        try:
            nn.functional.cross_entropy(model(x), y).backward()
        except RuntimeError as exc:
            if "NonFiniteGradientError" not in str(exc):
                raise
            now = residuals(state)
            unchanged.append(bool(np.array_equal(flat_params(model), weights)) and sorted(now) == sorted(kept)
                             and all(np.array_equal(now[k], kept[k]) for k in kept))
            skipped.append((step, str(exc)))
            continue
        opt.step()
    return {"propagated": all_nan, "skipped": skipped, "unchanged": unchanged, "params": flat_params(model)}


def scenario_failed_encode(rank):
    """Rank 1's encode of fc1.weight raises at step 1 (a plain error), at step 2 a
    NonFiniteGradientError: every rank's backward fails, rank 0's naming rank 1 and its message,
    and training goes on in step with the same parameters on both ranks."""
    from deepreduce.errors import NonFiniteGradientError

    model, opt, state = make(TOPK)
    encode, failures = state.pipeline.encode, {1: ValueError("boom"), 2: NonFiniteGradientError("overflowed")}

    def failing(tensor, name="", step=0):
        if rank == 1 and name == "fc1.weight" and step in failures:
            raise failures[step]
        return encode(tensor, name=name, step=step)

    state.pipeline.encode = failing
    errors = {}
    for step in range(4):
        x, y = batch(rank, step)
        opt.zero_grad()
        try:
            nn.functional.cross_entropy(model(x), y).backward()
        except RuntimeError as exc:
            errors[step] = str(exc)
            continue
        opt.step()
    return {"errors": errors, "params": flat_params(model)}


def scenario_disagreement(rank):
    config = dict(TOPK, sparsifier={"id": "topk", "ratio": 0.01 * (rank + 1)})
    model, _, _ = make(config)
    x, y = batch(rank, 0)
    mixed, _, _ = make(GradiVeQ() if rank else TOPK)
    return {"error": error_of(lambda: nn.functional.cross_entropy(model(x), y).backward()),
            "mixed": error_of(lambda: nn.functional.cross_entropy(mixed(x), y).backward())}


def scenario_bad_input(rank):
    model, _, _ = make(TOPK)
    return {
        "twice": error_of(lambda: ddp.register(model, TOPK)),
        "not_ddp": error_of(lambda: ddp.register(Net(), TOPK)),
        "bad_group": error_of(lambda: ddp.DeepReduceState(process_group="world")),
        "bad_names": error_of(lambda: ddp.DeepReduceState(named_parameters=[("a", 1)])),
        "bad_config": error_of(lambda: ddp.DeepReduceState(compression=dict(TOPK, sparsifier="nope"))),
        "bad_checkpoint": error_of(lambda: ddp.DeepReduceState(compression=TOPK).load_state_dict({"step": 1})),
    }


def scenario_whole_buckets(rank):
    """per_parameter=False with one DDP bucket: lossless trains exactly the per-parameter
    parameters; Top-r sends one container for the two large gradients (fc1, branch) and one per
    small parameter; ranks with different settings fail together."""
    whole = dict(branch=True, bucket_cap_mb=25, find_unused_parameters=True)
    params = {}
    for per_parameter in (True, False):
        model, opt, _ = make(LOSSLESS, per_parameter=per_parameter, **whole)
        train(model, opt, rank, 3, use_branch=True)
        params[per_parameter] = flat_params(model)
    model, opt, state = make(TOPK, per_parameter=False, **whole)
    sent = record_containers(state.pipeline)
    train(model, opt, rank, 3, use_branch=True)
    headers = {name: container.unpack(np.frombuffer(data, dtype=np.uint8)) for name, data in sent.items()}
    merged = {name: (c.shape, c.n) for name, c in headers.items() if name.startswith("bucket:")}
    mixed, _, _ = make(TOPK, per_parameter=bool(rank), **whole)
    x, y = batch(rank, 0)
    return {"lossless_equal": bool(np.array_equal(params[True], params[False])), "merged": merged,
            "others": sorted(n for n in headers if not n.startswith("bucket:")), "params": flat_params(model),
            "mixed": error_of(lambda: nn.functional.cross_entropy(mixed(x, True), y).backward())}


SCENARIOS = [scenario_collectives, scenario_summable_collectives, scenario_auto, scenario_lossless, scenario_sparse_allreduce, scenario_whole_buckets,
             scenario_gradiveq, scenario_topk_bytes, scenario_device_path, scenario_checkpoint, scenario_warmup,
             scenario_unused, scenario_bad_input, scenario_nonfinite, scenario_failed_encode, scenario_disagreement]


def run_scenarios(rank, world, port, queue, scenarios, watchdog_s: float) -> None:
    """Join a gloo group of ``world`` ranks on localhost:``port``, run every scenario, put
    ``(rank, {scenario name: result})`` on ``queue`` and leave the group; a rank still running
    after ``watchdog_s`` seconds dumps its stacks and exits (workers/watchdog.py)."""
    watchdog.arm(watchdog_s)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for scenario in scenarios:
            results[scenario.__name__] = scenario(rank)
    finally:
        queue.put((rank, results))
        watchdog.disarm()
        dist.destroy_process_group()


def run(rank, world, port, queue):
    run_scenarios(rank, world, port, queue, SCENARIOS, 220)


def run_hook_pickling(rank, world, port, queue):
    """The pickling pattern alone (its own launch: tests/test_torch_ddp.py)."""
    run_scenarios(rank, world, port, queue, [scenario_hook_pickling], 150)
