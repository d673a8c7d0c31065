"""``deepreduce fsdp-memory`` (experiments/cli/fsdp_memory.py) on the recommended FSDP configs:
4 gloo ranks as a 2x2 HSDP mesh, a small transformer. Persistent compressor state per rank is
measured from the live arrays and by tracemalloc; the recommended configs keep their residuals
within the rank's fp32 gradient shard (issue 32's memory target)."""
import pytest

from experiments.cli import fsdp_memory


@pytest.fixture(scope="module")
def rows():
    return fsdp_memory.run(fsdp_memory.RECOMMENDED + ("topk_raw", "fsdp_qsgd"), steps=2, timeout=400)


def test_recommended_configs_keep_persistent_state_within_the_fp32_gradient_shard(rows):
    for config in fsdp_memory.RECOMMENDED:
        mine = [r for r in rows if r["config"] == config]
        assert sorted(r["rank"] for r in mine) == [0, 1, 2, 3]
        for r in mine:
            assert r["steps"]["reduce_scatter"] >= 2 and r["steps"]["replicate"] >= 2
            residuals = r["state_bytes"] - r["bounds_bytes"]
            # the owner residual covers this rank's part of its shard in the replicate group of 2
            # (half of it at even bounds), not the whole shard; with the bounds, within the shard
            assert residuals <= r["shard_bytes"] // 2 + 4 * r["modules"], r
            assert r["state_bytes"] <= r["shard_bytes"], r
            # the sparse all-reduce's shard bounds: 3 int64 per FSDP module (replicate group of 2)
            assert r["bounds_bytes"] <= 24 * r["modules"], r
            assert r["traced_persistent"] >= residuals   # the allocator saw at least the arrays held


def test_error_feedback_configs_hold_a_residual_of_the_whole_reduce_scatter_input(rows):
    """``memory: residual`` configs: the reduce-scatter residual is the shard group's whole flat
    input (2 x the shard), plus the replicate residual (1 x): 3 x the shard, as docs/fsdp.md says."""
    for r in (r for r in rows if r["config"] == "topk_raw"):
        assert r["by_role"]["reduce_scatter"] == 2 * r["shard_bytes"]
        assert r["state_bytes"] - r["bounds_bytes"] == 3 * r["shard_bytes"]


def test_compact_residual_holds_its_codes_and_scales_only(rows):
    """``fsdp_qsgd`` (memory: compact_residual, block 64): the reduce-scatter residual of the
    shard group's whole flat input (2 x the shard's elements) is one int8 code per element and one
    float32 scale per 64: 2 x S / 4 x (1 + 4 / 64) bytes, 0.53 S, where a float32 one is 2 S."""
    mine = [r for r in rows if r["config"] == "fsdp_qsgd"]
    assert len(mine) == 4
    for r in mine:
        codes = 2 * r["shard_bytes"] // 4
        assert codes * 17 // 16 <= r["by_role"]["reduce_scatter"] <= codes * 17 // 16 + 4 * r["modules"], r
        assert r["by_role"]["replicate"] < r["shard_bytes"]        # its own codes plus the owner residual


def test_table_lists_each_config_once_with_its_ratio_to_the_shard(rows):
    text = fsdp_memory.table(rows)
    for config in fsdp_memory.RECOMMENDED + ("topk_raw",):
        assert text.count(f"| `{config}` |") == 1
    assert "| 3.00 |" in text   # topk_raw: 3 x the shard
