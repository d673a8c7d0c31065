"""A rank's host CPU beyond the codec in the cost model (copies, hand-overs, the collective's CPU,
the transport's background thread, oversubscription): the probes measure positive constants, the
model's step estimate grows as its terms say, the planner carries the same terms, and
``bench-scaling --real-engine`` prints measured against model per aggregation and N."""
from __future__ import annotations

import pytest

from deepreduce.collective.cost_model import (
    COPY_PASSES,
    CodecCosts,
    HostCosts,
    Link,
    host_seconds,
    sparse_allreduce_cost,
    step_collectives,
    step_cpu_s,
)
from deepreduce.collective.cost_probe import measure_collective_costs, measure_host_costs
from deepreduce.collective.planner import Bucket, Choice, PlanInputs, choice_cost, plan, step_cpu
from deepreduce.errors import ConfigError
from experiments.cli.bench_scaling import engine_model, engine_rows, mean_probe, print_engine
from experiments.engine_toy import compute_cpu_s

RAW = CodecCosts(name="topk_raw", ratio=0.01, encode_call_s=3e-5, encode_element_s=1e-9, decode_call_s=2e-5,
                 decode_element_s=1e-10, decode_entry_s=1e-8, header_bytes=34.0, entry_bytes=8.0)
HOST = HostCosts(copy_element_s=2e-10, hand_over_s=2e-5, call_s=1e-3, byte_s=5e-11, background_per_s=0.5)
NUMELS = (2_359_296, 1_048_576, 262_144)


def inputs(ranks: int, numels=NUMELS, host=HOST) -> PlanInputs:
    return PlanInputs(tuple(Bucket(f"t{i}", n, 0.0) for i, n in enumerate(numels)), ranks, Link(0.0, 1.0), (RAW,),
                      host=host)


class LocalTransport:
    """Two ranks' collectives in one process: every rank's payload is this one (a copy per rank),
    so the CPU grows with the bytes received, as a real transport's memcpy does."""

    ranks = 2

    def allgather(self, payload, name):
        return [payload.copy() for _ in range(self.ranks)]

    def alltoall(self, payloads, name):
        return [p.copy() for p in payloads]


def test_host_probe_measures_positive_constants():
    found = measure_collective_costs(LocalTransport().allgather, LocalTransport().alltoall, 0, 2,
                                     sizes=(1 << 10, 1 << 20, 1 << 23), repeat=3, busy_s=0.05)
    assert found["ranks"] == 2 and len(found["points"]) == 6
    assert all(seconds > 0 for *_, seconds in found["points"])
    assert found["byte_s"] > 0                 # copying 8 MB costs more than 1 KB
    assert found["background_per_s"] >= 0     # no transport thread here: about 0
    host = measure_host_costs(found, repeat=3, elements=1 << 20)
    assert host.copy_element_s > 0 and host.hand_over_s > 0
    assert (host.call_s, host.byte_s) == (found["call_s"], found["byte_s"])
    assert 0 < compute_cpu_s((1 << 16, 1 << 12), steps=2)


def test_host_probes_refuse_bad_arguments():
    with pytest.raises(ConfigError, match="2 or more ranks"):
        measure_collective_costs(LocalTransport().allgather, LocalTransport().alltoall, 0, 1)
    with pytest.raises(ConfigError, match="sizes must be integers >= ranks"):
        measure_collective_costs(LocalTransport().allgather, LocalTransport().alltoall, 0, 2, sizes=(1,))
    with pytest.raises(ConfigError, match="measure_collective_costs' output"):
        measure_host_costs({"call_s": 1e-3})
    with pytest.raises(ConfigError, match="repeat must be an integer >= 1"):
        measure_host_costs({"call_s": 0, "byte_s": 0, "background_per_s": 0}, repeat=0)


def test_encode_has_a_per_entry_cost_and_old_figures_still_load():
    with_entries = CodecCosts(**dict(RAW.to_dict(), encode_entry_s=1e-8))
    assert with_entries.encode_s(1e6) == pytest.approx(RAW.encode_s(1e6) + 1e4 * 1e-8)   # k = 1% of 1M
    # phase one selects k entries of the whole tensor, the owner k/N of its shard
    assert sparse_allreduce_cost(Link(0.0, 1.0), 4, 1e6, with_entries).encode_s == pytest.approx(
        sparse_allreduce_cost(Link(0.0, 1.0), 4, 1e6, RAW).encode_s + (1e4 + 1e4 / 4) * 1e-8)
    saved = {k: v for k, v in RAW.to_dict().items() if k != "encode_entry_s"}   # a file from before the field
    assert CodecCosts.from_dict(saved) == RAW and RAW.encode_entry_s == 0.0
    with pytest.raises(ConfigError, match="encode_entry_s must be a finite number >= 0"):
        CodecCosts(**dict(RAW.to_dict(), encode_entry_s=-1.0))


def test_host_costs_validate_and_round_trip():
    assert HostCosts.from_dict(HOST.to_dict()) == HOST
    with pytest.raises(ConfigError, match="host costs call_s must be a finite number >= 0"):
        HostCosts(copy_element_s=0, hand_over_s=0, call_s=-1, byte_s=0, background_per_s=0)
    with pytest.raises(ConfigError, match="note must be a string"):
        HostCosts(copy_element_s=0, hand_over_s=0, call_s=0, byte_s=0, background_per_s=0, note=1)
    with pytest.raises(ConfigError, match="unknown keys"):
        HostCosts.from_dict(dict(HOST.to_dict(), extra=1))


def test_host_seconds_hand_computed():
    # allgather of 1M elements: 3 passes, one hand-over, one collective, 1 kB received
    assert host_seconds(HOST, "allgather", 1e6, 1000, 1) == pytest.approx(3 * 1e6 * 2e-10 + 2e-5 + 1e-3 + 1000 * 5e-11)
    assert host_seconds(HOST, "dense", 1e6, 0, 1) == pytest.approx(2e-5 + 1e-3)   # summed in place by the collective
    assert set(COPY_PASSES) == {"dense", "fp16", "allgather", "sparse_allreduce"}
    with pytest.raises(ConfigError, match="unknown aggregation 'gossip'"):
        host_seconds(HOST, "gossip", 1, 0, 1)


def test_step_collectives():
    assert step_collectives("allgather", 3) == 3
    assert step_collectives("sparse_allreduce", 3) == 2   # one alltoall and one allgather per step
    assert step_collectives("dense", 3) == 3
    with pytest.raises(ConfigError, match="unknown aggregation 'gossip'"):
        step_collectives("gossip", 1)
    with pytest.raises(ConfigError, match="unknown aggregation 'gossip'"):
        step_cpu_s([], "gossip", HOST)


def test_step_cpu_hand_computed_and_growing_as_its_terms_say():
    compute = 2e-3
    costs = [choice_cost(Choice("allgather", "topk_raw"), n, inputs(2)) for n in NUMELS]
    own = compute + sum(c.encode_s + c.decode_s for c in costs) + sum(
        host_seconds(HOST, "allgather", n, c.received_bytes, 0) for n, c in zip(NUMELS, costs))
    expected = own * 1.5 + 3 * HOST.call_s
    assert step_cpu(Choice("allgather", "topk_raw"), NUMELS, inputs(2), compute) == pytest.approx(expected)
    # the sparse all-reduce's collectives are one alltoall and one allgather per step, whatever its tensors
    sparse = [choice_cost(Choice("sparse_allreduce", "topk_raw"), n, inputs(2)) for n in NUMELS]
    own = compute + sum(c.encode_s + c.decode_s for c in sparse) + sum(
        host_seconds(HOST, "sparse_allreduce", n, c.received_bytes, 0) for n, c in zip(NUMELS, sparse))
    assert step_cpu(Choice("sparse_allreduce", "topk_raw"), NUMELS, inputs(2), compute) == pytest.approx(
        own * 1.5 + 2 * HOST.call_s)
    slower = HostCosts(**dict(HOST.to_dict(), call_s=10 * HOST.call_s, background_per_s=1.0))   # probed past the cores
    for aggregation in ("allgather", "sparse_allreduce"):
        choice = Choice(aggregation, "topk_raw")
        small = step_cpu(choice, [n // 4 for n in NUMELS], inputs(2, [n // 4 for n in NUMELS]), compute)
        assert step_cpu(choice, NUMELS, inputs(2), compute) > small      # grows with the tensors' sizes
        per_n = [step_cpu(choice, NUMELS, inputs(n), compute) for n in (2, 4, 8)]
        if aggregation == "allgather":
            assert per_n[0] < per_n[1] < per_n[2]                       # decodes N - 1 containers
        assert step_cpu(choice, NUMELS, inputs(8, host=slower), compute) > per_n[2]   # the polling it measured
    with pytest.raises(ConfigError, match="needs plan inputs with host costs"):
        step_cpu(Choice("allgather", "topk_raw"), NUMELS, inputs(2, host=None))


def test_the_planner_carries_the_host_terms():
    bare, full = inputs(4, host=None), inputs(4)
    for choice in (Choice("dense"), Choice("fp16"), Choice("allgather", "topk_raw"),
                   Choice("sparse_allreduce", "topk_raw")):
        without, with_host = choice_cost(choice, NUMELS[0], bare), choice_cost(choice, NUMELS[0], full)
        assert without.host_s == 0 and with_host.host_s > 0
        assert with_host.total_s == pytest.approx(without.total_s + with_host.host_s)
    assert PlanInputs.from_bytes(full.to_bytes()) == full
    assert "host" not in bare.to_dict()   # inputs without host costs serialise as before
    assert plan(full).exposed_s > plan(bare).exposed_s
    with pytest.raises(ConfigError, match="host must be HostCosts or None"):
        PlanInputs(full.buckets, 4, Link(0.0, 1.0), (RAW,), host={"call_s": 1})


def test_bench_prints_measured_against_model_per_aggregation_and_n(capsys):
    rows = [dict(aggregation=a, codec="topk_raw", ranks=n, numels=list(NUMELS), wall_s=0.02 * n, cpu_s=0.02 * n,
                 encode_s=0.005, communication_s=0.01, decode_s=0.001)
            for n in (2, 4) for a in ("allgather", "sparse_allreduce")]
    modelled = engine_model(rows, [RAW], HOST, 2e-3)
    assert [r["model_cpu_s"] for r in modelled] == pytest.approx(
        [step_cpu(Choice(r["aggregation"], "topk_raw"), NUMELS, inputs(r["ranks"]), 2e-3) for r in rows])
    print_engine(rows, [RAW], HOST, 2e-3, cores=2)
    out = capsys.readouterr().out
    assert "measured/model" in out and "model inputs: compute 2.00 ms" in out
    lines = [line.split() for line in out.splitlines() if line.split()[:1] in (["allgather"], ["sparse_allreduce"])]
    assert len(lines) == 4
    for line, r in zip(lines, modelled):
        assert float(line[7]) == pytest.approx(1e3 * r["model_cpu_s"], abs=0.06)
        assert float(line[8]) == pytest.approx(r["cpu_s"] / r["model_cpu_s"], abs=0.006)
    assert "measured / model at N <= 2 cores" in out and "measured / model at N > 2 cores" in out
    for r in modelled:
        assert sum(r["model_parts"]) == pytest.approx(r["model_cpu_s"]) and min(r["model_parts"]) > 0
    probed = [dict(r, collective={"call_s": 5e-3, "byte_s": 0.0, "background_per_s": 1.0}) for r in rows]
    at_n = engine_model(probed, [RAW], HOST, 2e-3)   # a row probed at its N: that probe's collective figures
    assert all(r["model_host"].call_s == 5e-3 and r["model_host"].background_per_s == 1.0 for r in at_n)
    assert all(p["model_cpu_s"] > r["model_cpu_s"] for p, r in zip(at_n, modelled))
    out = '[1,0]<stdout>:COLLECTIVE {"call_s": 0.001}[1,0]<stdout>:\n[1,0]<stdout>:ENGINE {"ranks": 2}\n'
    assert engine_rows(out, "COLLECTIVE ") == [{"call_s": 0.001}] and engine_rows(out) == [{"ranks": 2}]
    before, after = {"call_s": 1e-3, "byte_s": 0.0, "background_per_s": 0.5}, {"call_s": 3e-3, "byte_s": 2e-11,
                                                                               "background_per_s": 1.0}
    assert mean_probe([before, after]) == pytest.approx({"call_s": 2e-3, "byte_s": 1e-11, "background_per_s": 0.75})
    assert mean_probe([]) is None
    print_engine(rows, [RAW])   # without host costs: the codec's CPU alone, as before
    assert "model inputs" not in capsys.readouterr().out



def test_a_compute_probed_in_the_ranks_is_the_compute_term():
    """``bench-scaling --real-engine``: where the launch's probe timed the toy compute in the ranks
    (every rank at once), that figure is the model's compute term; the other terms stay."""
    row = dict(aggregation="sparse_allreduce", codec="topk_raw", ranks=8, numels=list(NUMELS), wall_s=0.1,
               cpu_s=0.05, encode_s=0.005, communication_s=0.01, decode_s=0.001)
    probe = {"call_s": 5e-3, "byte_s": 1e-11, "background_per_s": 0.5}
    plain, = engine_model([dict(row, collective=probe)], [RAW], HOST, 2e-3)
    probed, = engine_model([dict(row, collective=dict(probe, compute_s=3e-3))], [RAW], HOST, 2e-3)
    assert plain["model_parts"][0] == pytest.approx(2e-3) and probed["model_parts"][0] == pytest.approx(3e-3)
    assert probed["model_parts"][1:4] == pytest.approx(plain["model_parts"][1:4])   # codec, glue, collectives
    assert probed["model_cpu_s"] > plain["model_cpu_s"]
    assert mean_probe([dict(probe, compute_s=2e-3), dict(probe, compute_s=4e-3)])["compute_s"] == pytest.approx(3e-3)
    assert "compute_s" not in mean_probe([dict(probe, compute_s=2e-3), probe])   # only where every probe has it
