"""``deepreduce bench-scaling --hsdp`` (experiments/hsdp_model.py): HSDP's replicate all-reduce
modelled for 7B and 70B transformer shapes on N nodes x 8 accelerators, bf16 against
deepreduce's sparse all-reduce; the parser, the output and the model's arithmetic."""
import json

import pytest

from deepreduce.cli import main
from deepreduce.collective.cost_model import CodecCosts
from deepreduce.errors import ConfigError
from experiments import hsdp_model

CODEC = CodecCosts("fsdp_topk", 0.05, 2e-5, 2e-9, 1e-5, 5e-10, 5e-9, 64.0, 4.6)


def test_transformer_shapes_count_the_published_parameters():
    assert hsdp_model.MODELS["7b"].parameters() == 6_738_415_616    # LLaMA-2 7B
    assert hsdp_model.MODELS["70b"].parameters() == 68_976_648_192  # LLaMA-2 70B
    assert len(hsdp_model.MODELS["70b"].modules()) == 82            # embedding, 80 blocks, output


def test_bf16_ring_bytes_and_deepreduce_bytes_flat_in_the_number_of_nodes():
    found = hsdp_model.rows("7b", [2, 512], [100.0], CODEC)
    two, many = found
    shard = hsdp_model.MODELS["7b"].parameters() / 8
    assert two.bf16_bytes == pytest.approx(2 * shard)               # 2(N-1)/N x 2 bytes, N = 2
    assert many.bf16_bytes == pytest.approx(2 * 511 / 512 * 2 * shard)
    # the sparse all-reduce sends 2 (N-1)/N x k entries: at most twice N = 2's at 512 nodes (flat
    # from there on, as the bf16 ring), about 1/8.7 of the bf16 ring at ratio 0.05, 4.6 B/entry
    assert many.deepreduce_bytes < 2.01 * two.deepreduce_bytes
    assert 0.10 < many.bytes_ratio < 0.12
    assert two.intra_s == many.intra_s > 0
    assert many.bf16_s > two.bf16_s and many.comm_speedup < two.comm_speedup


def test_bench_scaling_hsdp_prints_a_table_per_model_and_bandwidth(tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"codecs": [CODEC.to_dict()],
                                 "powersgd": {"mac_s": 1e-10, "orth_s": 1e-9, "element_s": 1e-9}}))
    assert main(["bench-scaling", "--hsdp", "--costs", str(costs), "--nodes", "2,512", "--hsdp-gbits", "25,400"]) == 0
    out = capsys.readouterr().out
    assert out.count("HSDP, 7B transformer") == 2 and out.count("HSDP, 70B transformer") == 2
    assert "6,738,415,616 parameters" in out and "sparse all-reduce of fsdp_topk" in out
    lines = [line.split() for line in out.splitlines() if line.strip().startswith(("2 ", "512 "))]
    assert len(lines) == 8 and all(len(fields) == 9 and fields[7].endswith("x") for fields in lines)


def test_bench_scaling_hsdp_refuses_bad_node_counts(tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"codecs": [CODEC.to_dict()],
                                 "powersgd": {"mac_s": 1e-10, "orth_s": 1e-9, "element_s": 1e-9}}))
    with pytest.raises(ConfigError, match="--nodes"):
        main(["bench-scaling", "--hsdp", "--costs", str(costs), "--nodes", "0,2"])
