"""experiments/sra_bytes.py: the per-phase account of what a rank receives in the sparse all-reduce."""
from experiments import sra_bytes

CONFIG = {"sparsifier": {"id": "chunk_topk", "chunk": 256, "k": 8}, "index": {"id": "chunk_enum", "chunk": 256},
          "value": {"id": "binmean", "bits": 2}, "memory": {"id": "decayed_residual", "decay": 0.95},
          "min_numel": 500}
SHAPES = {"w": 8192, "v": 4096, "bias": 64}   # whole chunks for 2 and 4 ranks, and one dense tensor


def test_entries_grow_as_2_n_minus_1_over_n_and_fixed_bytes_as_n_minus_1():
    acc = {n: sra_bytes.account(CONFIG, n, SHAPES, steps=4) for n in (2, 4)}
    for n in (2, 4):
        assert acc[n]["1"] == acc[n]["2"]   # the owner's containers are the size of the senders'
        assert acc[n]["1"]["codebook"] == (n - 1) * 2 * 16   # two sparse tensors, 4 float32 means each
    entries = {n: sum(acc[n][p][k] for p in "12" for k in ("index", "value")) for n in (2, 4)}
    fixed = {n: sum(acc[n][p][k] for p in "12" for k in sra_bytes.FIXED) for n in (2, 4)}
    assert abs(entries[4] / entries[2] - 1.5) < 0.01   # 1.5x but for each section's rounding up to whole bytes
    assert 2.5 < fixed[4] / fixed[2] <= 3.0   # 2 (N - 1) containers per tensor (the dense bias's header is smaller)
