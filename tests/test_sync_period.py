"""The sync period H as the planner's third choice (deepreduce.collective.sync_period) and
``bench-scaling --sync-every``'s tables."""
import pytest

from deepreduce.cli import main
from deepreduce.collective.cost_model import CodecCosts, Link, allgather_cost, dense_cost
from deepreduce.collective.sync_period import (
    OuterOption,
    choose,
    exposed_outer_s,
    predict,
    table,
)
from deepreduce.errors import ConfigError

RAW = CodecCosts("topk_raw", 0.01, 20e-6, 2e-9, 20e-6, 0.0, 5e-9, 64, 8)
LINK = Link.from_gbit(0.1, alpha_s=0.0)          # 100 Mbit/s
NUMEL = 10_000_000
COMPUTE = 0.5


def test_dense_period_one_is_ddp_and_the_outer_cost_divides_by_h():
    dense = OuterOption("dense")
    cost = dense_cost(LINK, 2, NUMEL)
    one = predict(dense, LINK, 2, NUMEL, COMPUTE, 1)
    assert one.step_s == pytest.approx(COMPUTE + cost.comm_s)
    thirty = predict(dense, LINK, 2, NUMEL, COMPUTE, 30)
    assert thirty.step_s == pytest.approx(COMPUTE + cost.comm_s / 30)
    # fp32 ring all-reduce on 2 ranks sends the model once: 32 bits per parameter per sync
    assert one.sent_bits_per_param == pytest.approx(32.0)
    assert thirty.sent_bits_per_param == pytest.approx(32.0 / 30)


def test_int8_and_bf16_send_a_quarter_and_a_half_of_fp32():
    bits = {name: predict(OuterOption(name), LINK, 4, NUMEL, COMPUTE, 10).sent_bits_per_param
            for name in ("dense", "bf16", "int8")}
    assert bits["bf16"] == pytest.approx(bits["dense"] / 2)
    assert bits["int8"] == pytest.approx(bits["dense"] / 4)


def test_coded_options_price_encode_link_and_decode():
    option = OuterOption("allgather", RAW)
    cost = allgather_cost(LINK, 4, NUMEL, RAW)
    p = predict(option, LINK, 4, NUMEL, COMPUTE, 10)
    assert p.outer_s == pytest.approx(cost.total_s)
    assert p.option == "ag:topk_raw"
    assert OuterOption("sparse_allreduce", RAW).label == "sa:topk_raw"


def test_delay_hides_link_time_but_not_codec_time():
    cost = allgather_cost(LINK, 2, NUMEL, RAW)
    assert exposed_outer_s(cost, COMPUTE, delay=0) == pytest.approx(cost.total_s)
    hidden = exposed_outer_s(cost, 10.0, delay=5)
    assert hidden == pytest.approx(cost.encode_s + cost.decode_s)
    # fragments: the same link time, each fragment hidden separately
    big = dense_cost(LINK, 2, NUMEL)
    assert exposed_outer_s(big, COMPUTE, delay=1, fragments=4) == pytest.approx(
        4 * max(0.0, big.comm_s / 4 - COMPUTE))


def test_choose_takes_the_smallest_period_within_the_slack():
    options = [OuterOption("dense"), OuterOption("allgather", RAW)]
    pick = choose(options, LINK, 2, NUMEL, COMPUTE, slack=0.05)
    assert pick.step_s <= COMPUTE * 1.05
    for h in (1, 2, 5, 10, 20, 30, 50, 100, 200, 500):
        if h >= pick.sync_every:
            break
        assert all(predict(o, LINK, 2, NUMEL, COMPUTE, h).step_s > COMPUTE * 1.05 for o in options)
    # the compressed option reaches the budget at a smaller H than dense fp32 alone
    dense_only = choose([OuterOption("dense")], LINK, 2, NUMEL, COMPUTE, slack=0.05)
    assert pick.sync_every < dense_only.sync_every
    # an impossible budget: the fastest at the largest candidate
    slow = Link.from_gbit(1e-5, alpha_s=0.0)
    worst = choose(options, slow, 2, NUMEL, COMPUTE, candidates=(1, 10), slack=0.0)
    assert worst.sync_every == 10


def test_table_is_option_major_and_bad_inputs_name_the_problem():
    rows = table([OuterOption("dense"), OuterOption("int8")], LINK, 2, NUMEL, COMPUTE, candidates=(1, 30))
    assert [(r.option, r.sync_every) for r in rows] == [("dense", 1), ("dense", 30), ("int8", 1), ("int8", 30)]
    with pytest.raises(ConfigError, match="unknown aggregation 'ring'"):
        OuterOption("ring")
    with pytest.raises(ConfigError, match="needs a codec"):
        OuterOption("allgather")
    with pytest.raises(ConfigError, match="takes no codec"):
        OuterOption("dense", RAW)
    with pytest.raises(ConfigError, match="sync_every must be an integer >= 1"):
        predict(OuterOption("dense"), LINK, 2, NUMEL, COMPUTE, 0)
    with pytest.raises(ConfigError, match="fragments must be >= 1"):
        exposed_outer_s(dense_cost(LINK, 2, NUMEL), COMPUTE, fragments=0)
    with pytest.raises(ConfigError, match="at least one option"):
        choose([], LINK, 2, NUMEL, COMPUTE)


def test_bench_scaling_prints_the_sync_period_tables(tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text('{"codecs": [%s], "powersgd": {"mac_s": 1e-11, "orth_s": 1e-9, "element_s": 1e-9}}'
                     % __import__("json").dumps(RAW.to_dict()))
    assert main(["bench-scaling", "--quick", "--costs", str(costs), "--sync-every", "1,30,100",
                 "--sync-ranks", "2,8"]) == 0
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if line.startswith("option")]
    assert len(headers) == 2 and headers[0].split()[1:4] == ["H=1", "H=30", "H=100"]
    labels = {line.split()[0] for line in out.splitlines() if line.split() and line.split()[0] in
              ("dense", "bf16", "int8", "ag:topk_raw", "sa:topk_raw")}
    assert labels == {"dense", "bf16", "int8", "ag:topk_raw", "sa:topk_raw"}
    assert out.count("planner: ") == 2


def test_chunked_configs_are_priced_at_k_per_chunk():
    """A chunk_topk of k per chunk of C is measured as the ratio k / C (the same selection), so
    bench-scaling --sync-every and DiLoCo(sync_every="auto") price the semi-synchronous configs."""
    from deepreduce.collective.cost_probe import measure_codec_costs, with_ratio

    topk = {"sparsifier": {"id": "topk", "ratio": 0.01}, "index": "raw", "value": "raw"}
    assert with_ratio(topk) is topk
    chunked = {"sparsifier": {"id": "chunk_topk", "chunk": 4096, "k": 64}, "index": "raw", "value": "raw"}
    assert with_ratio(chunked)["sparsifier"] == {"id": "chunk_topk", "chunk": 4096, "k": 0, "ratio": 64 / 4096}
    costs = measure_codec_costs("sparseloco", sizes=(1 << 14, 1 << 15), repeat=1, clock="wall")
    assert costs.ratio == 64 / 4096 and costs.name == "sparseloco"
    assert 1 < costs.entry_bytes < 4   # 12-bit chunk-local indices and 2-bit values per entry
