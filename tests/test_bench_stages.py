"""deepreduce bench-stages: every stage is timed, and the peer's containers are decoded in full."""
from deepreduce.config import build
from experiments import gradients
from experiments.cli.bench_stages import measure


def test_receiver_decodes_the_peers_containers_in_full():
    grads = {"conv": gradients.get(sorted(k for k in gradients.load() if k != "all")[-1])}
    pipe = build("configs/bf_p0.yaml")
    rows = measure(pipe, build("configs/bf_p0.yaml"), grads, ranks=2, repeat=2)
    assert len(rows["encode + decode"]) == 2
    # the peer's container is not this rank's own: its Bloom filter is queried on decode
    assert min(rows["decode: index.decode"]) > 0
    assert pipe.stats.tensors_decoded == 2 * 3        # 3 iterations (1 warm-up), 2 containers each
