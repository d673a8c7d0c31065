"""GradiVeQ through an unmodified horovod.torch.DistributedOptimizer and deepreduce's own, 2 ranks."""
import json
import re

import pytest
from conftest import run_ranks


@pytest.mark.parametrize("optimizer", ["horovod", "deepreduce"])
def test_two_ranks_stay_identical_and_loss_falls(optimizer):
    out = run_ranks("horovodrun", "gradiveq_training.py", optimizer)
    # records may carry an MPI prefix such as "[1,0]<stdout>:", and two ranks' records can share
    # one line of the launcher's output: decode each JSON object where its status word ends
    decoder = json.JSONDecoder()
    lines = [(m.group(1), decoder.raw_decode(out.stdout, m.end())[0])
             for m in re.finditer(r"(OK|FAIL) (?=\{)", out.stdout)]
    assert len(lines) == 2 and all(status == "OK" for status, _ in lines), out.stdout
    result = lines[0][1]
    assert result["identical"] and result["last"] < result["first"] and result["ratio"] > 1
