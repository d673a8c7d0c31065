"""Horovod's TensorFlow patterns with deepreduce's tape and Keras callback on 2 mpirun ranks
(workers/tf_dropin.py; a hung rank dumps its stacks and exits)."""
import json

from conftest import run_ranks


def test_tape_step_run_eagerly_then_in_a_graph_and_broadcast_with_local_variables(tmp_path):
    run_ranks("mpirun", "tf_dropin.py", str(tmp_path), timeout=240)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["eager_then_graph"] == {"eager_ok": True, "graph_ok": True}, r
        assert r["local_variables"] == {"shared_equal": True, "local_kept": True}, r
