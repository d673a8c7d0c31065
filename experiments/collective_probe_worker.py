"""One rank of the collective probe of ``deepreduce bench-scaling --real-engine``: a rank's CPU in
Horovod's allgather and alltoall on this machine (:func:`deepreduce.collective.cost_probe.measure_collective_costs`),
launched once by ``horovodrun -np 2`` (ranks <= cores, so no rank polls while another runs on
its core). Rank 0 prints one ``COLLECTIVE {...}`` JSON line."""
from __future__ import annotations

import json

import horovod.torch as hvd
import numpy as np
import torch

from deepreduce.collective.cost_probe import measure_collective_costs


def allgather(payload: np.ndarray, name: str):
    return hvd.allgather(torch.from_numpy(payload), name=name)


def alltoall(payloads, name: str):
    sizes = torch.tensor([p.size for p in payloads], dtype=torch.int32)
    return hvd.alltoall(torch.from_numpy(np.concatenate(payloads)), splits=sizes, name=name)


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    found = measure_collective_costs(allgather, alltoall, hvd.rank(), hvd.size())
    if hvd.rank() == 0:
        print("COLLECTIVE " + json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
