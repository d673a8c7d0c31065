"""The planner follows the cost model on synthetic costs, is deterministic and serialisable, and
``deepreduce bench-scaling --quick`` prints its table."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepreduce.cli import main
from deepreduce.collective.cost_model import CodecCosts, Link
from deepreduce.collective.planner import (
    SLACK_TOLERANCE_S,
    Bucket,
    Choice,
    PlanInputs,
    alternatives,
    buckets_from_timeline,
    choice_cost,
    drift,
    exposed_seconds,
    format_plan,
    needs_replan,
    plan,
)
from deepreduce.errors import ConfigError
from experiments.cli.bench_scaling import compare_with_runs, engine_rows

RAW = CodecCosts(name="topk_raw", ratio=0.01, encode_call_s=3e-5, encode_element_s=1e-9, decode_call_s=2e-5,
                 decode_element_s=1e-10, decode_entry_s=1e-8, header_bytes=34.0, entry_bytes=8.0)
BLOOM = CodecCosts(name="bf_p0", ratio=0.01, encode_call_s=4e-5, encode_element_s=4e-9, decode_call_s=2e-5,
                   decode_element_s=2.5e-9, decode_entry_s=2e-8, header_bytes=40.0, entry_bytes=5.8)
BUCKETS = tuple(Bucket(f"b{i}", 5_000_000, 0.02 * (4 - i)) for i in range(5))


def inputs(ranks=8, gbit=10.0, buckets=BUCKETS, codecs=(RAW, BLOOM), **kw) -> PlanInputs:
    return PlanInputs(buckets, ranks, Link.from_gbit(gbit), codecs, **kw)


def test_huge_bandwidth_sends_dense():
    result = plan(inputs(gbit=1e6))
    assert {b.choice for b in result.buckets} <= {Choice("dense"), Choice("fp16")}
    assert all(b.choice == Choice("dense") for b in result.buckets[:-1])   # they hide: the lossless choice


def test_slow_link_and_many_ranks_send_sparse_allreduce():
    result = plan(inputs(ranks=256, gbit=1.0, buckets=tuple(Bucket(b.name, b.numel, 0.0) for b in BUCKETS)))
    assert all(b.choice == Choice("sparse_allreduce", "topk_raw") for b in result.buckets)


def test_a_bucket_hidden_behind_backward_goes_dense():
    buckets = (Bucket("early", 5_000_000, 10.0), Bucket("last", 5_000_000, 0.0))
    result = plan(inputs(gbit=1.0, buckets=buckets))
    early, last = result.buckets
    assert early.cost(Choice("dense")).total_s > early.cost(Choice("sparse_allreduce", "topk_raw")).total_s
    assert early.choice == Choice("dense")          # compression would gain it nothing
    assert last.choice.aggregation in ("allgather", "sparse_allreduce")
    assert result.exposed_s == pytest.approx(last.cost().total_s)


def test_fixed_plan_and_exposed_time_follow_the_timeline():
    data = inputs()
    dense = plan(data, fixed=Choice("dense"))
    durations = [choice_cost(Choice("dense"), b.numel, data).total_s for b in BUCKETS]
    assert dense.exposed_s == pytest.approx(exposed_seconds([b.hide_s for b in BUCKETS], durations))
    assert exposed_seconds([0.5, 0.0], [0.1, 0.2]) == pytest.approx(0.2)     # the first hides entirely
    assert exposed_seconds([0.1, 0.0], [0.5, 0.2]) == pytest.approx(0.6)     # it delays the second
    assert [b.bucket.name for b in plan(inputs(buckets=BUCKETS[::-1])).buckets] == [b.name for b in BUCKETS]


def test_plan_is_deterministic_and_survives_serialisation():
    data = inputs(ranks=64)
    payload = data.to_bytes()
    again = PlanInputs.from_bytes(payload)
    assert again == data and again.to_bytes() == payload
    assert PlanInputs.from_dict(json.loads(json.dumps(data.to_dict()))) == data
    assert plan(again) == plan(data)
    assert plan(data).choices() == plan(inputs(ranks=64)).choices()


@pytest.mark.parametrize("payload, message", [
    (b"\xff", "not the bytes of PlanInputs.to_bytes"),
    (b'{"version": 99}', "expected a dict of version 1"),
    (b'{"version": 1, "ranks": 2}', "malformed dict"),
])
def test_from_bytes_refuses_foreign_payloads(payload, message):
    with pytest.raises(ConfigError, match=message):
        PlanInputs.from_bytes(payload)


@pytest.mark.parametrize("kwargs, message", [
    (dict(buckets=()), "buckets must not be empty"),
    (dict(buckets=(Bucket("a", 10, 0.0), Bucket("a", 10, 0.0))), "bucket names must be distinct"),
    (dict(aggregations=("ring",)), "aggregations must be some of"),
    (dict(codecs=(), aggregations=("allgather",)), "no alternative"),
    (dict(ranks=0), "ranks must be an integer >= 1"),
])
def test_plan_inputs_refuse_bad_values(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        inputs(**kwargs)


def test_bucket_refuses_bad_values():
    with pytest.raises(ConfigError, match="numel must be an integer >= 1"):
        Bucket("a", 0, 0.0)
    with pytest.raises(ConfigError, match="bucket a hide_s"):
        Bucket("a", 10, -1.0)


codec_costs = st.builds(
    CodecCosts, name=st.sampled_from(["a", "b"]), ratio=st.floats(0.001, 0.5),
    encode_call_s=st.floats(0, 1e-3), encode_element_s=st.floats(0, 1e-8), decode_call_s=st.floats(0, 1e-3),
    decode_element_s=st.floats(0, 1e-8), decode_entry_s=st.floats(0, 1e-7), header_bytes=st.floats(0, 100),
    entry_bytes=st.floats(1, 16))


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 10 ** 8), st.floats(0, 0.5)), min_size=1, max_size=8),
       ranks=st.integers(1, 2048), gbit=st.floats(0.1, 400), alpha=st.floats(0, 1e-4),
       codecs=st.lists(codec_costs, min_size=1, max_size=2, unique_by=lambda c: c.name))
def test_auto_is_never_worse_than_any_fixed_choice(sizes, ranks, gbit, alpha, codecs):
    buckets = tuple(Bucket(f"b{i}", numel, hide) for i, (numel, hide) in enumerate(sizes))
    data = PlanInputs(buckets, ranks, Link.from_gbit(gbit, alpha), tuple(codecs))
    auto = plan(data)
    tolerance = len(buckets) * SLACK_TOLERANCE_S
    for choice in alternatives(data):
        assert auto.exposed_s <= plan(data, fixed=choice).exposed_s + tolerance, choice
    fastest = exposed_seconds([b.bucket.hide_s for b in auto.buckets],
                              [min(c.total_s for _, c in b.costs) for b in auto.buckets])
    assert auto.exposed_s <= fastest + tolerance     # the optimum of the model


def test_drift_and_needs_replan():
    old = inputs()
    assert drift(old, inputs()) == 0.0 and not needs_replan(old, inputs())
    slower = inputs(codecs=(CodecCosts.from_dict({**RAW.to_dict(), "encode_element_s": 2e-9}), BLOOM))
    assert needs_replan(old, slower)
    nudged = inputs(codecs=(CodecCosts.from_dict({**RAW.to_dict(), "encode_element_s": 1.01e-9}), BLOOM))
    assert 0 < drift(old, nudged) < 0.02 and not needs_replan(old, nudged)
    assert drift(old, inputs(ranks=16)) == math.inf
    with pytest.raises(ConfigError, match="threshold must be > 0"):
        needs_replan(old, slower, threshold=0)


def test_format_plan_prints_one_table():
    text = format_plan(plan(inputs(ranks=64)))
    lines = text.splitlines()
    assert lines[1].split()[:4] == ["bucket", "numel", "hide_ms", "choice"]
    assert "sparse_allreduce:topk_raw" in lines[1] and "dense" in lines[1]
    assert sum(line.startswith("b") and "*" in line for line in lines) == len(BUCKETS)
    assert lines[-1].startswith("exposed communication after backward:")


def test_buckets_from_timeline():
    buckets = buckets_from_timeline(["a", "b"], [10, 20], [1.0, 3.5], 3.0)
    assert buckets == (Bucket("a", 10, 2.0), Bucket("b", 20, 0.0))
    with pytest.raises(ConfigError, match="equal lengths"):
        buckets_from_timeline(["a"], [1, 2], [0.0], 1.0)


def test_compare_with_runs_hook():
    predicted = choice_cost(Choice("allgather", "topk_raw"), 1_000_000, inputs(ranks=4)).received_bytes
    rows = compare_with_runs([{"aggregation": "allgather", "codec": "topk_raw", "ranks": 4, "numels": [1_000_000],
                               "received_bytes": predicted, "decode_s": 0.01}], [RAW])
    assert rows[0]["predicted_bytes"] == pytest.approx(predicted)
    assert rows[0]["predicted_decode_s"] == pytest.approx(3 * RAW.decode_s(1e6, 1e4))


def test_bench_scaling_quick_prints_the_table(tmp_path, capsys):
    costs = tmp_path / "costs.json"
    assert main(["bench-scaling", "--quick", "--save-costs", str(costs)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("N "))
    for column in ("dense", "fp16", "powersgd4", "ag:topk_raw", "sa:elias_fano", "sa:bf_p0", "auto"):
        assert column in header.split()
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in ("2", "8", "64")]
    assert [r[0] for r in rows] == ["2", "8", "64"]
    assert "allgather's crossover N against dense fp32" in out
    assert "auto never slower than dense: holds" in out
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([{"aggregation": "dense", "ranks": 2, "numels": [1000], "received_bytes": 4000}]))
    assert main(["bench-scaling", "--quick", "--costs", str(costs), "--runs", str(runs)]) == 0
    assert "model against real runs" in capsys.readouterr().out


def test_engine_rows_read_one_json_object_per_line_whatever_horovodrun_appends():
    """bench-scaling --real-engine parses its workers' lines; horovodrun runs prefixes on into them."""
    out = ('[1,0]<stdout>:ENGINE {"aggregation": "allgather", "ranks": 2}[1,0]<stdout>:\n'
           'noise\n[1,0]<stdout>:ENGINE {"aggregation": "sparse_allreduce", "ranks": 2}\n')
    assert engine_rows(out) == [{"aggregation": "allgather", "ranks": 2},
                                {"aggregation": "sparse_allreduce", "ranks": 2}]
