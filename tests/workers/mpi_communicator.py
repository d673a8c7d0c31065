"""Worker: the mpi4py communicator gathers containers of different sizes from every rank."""
import numpy as np

import deepreduce
from deepreduce.collective.comm.mpi import MPICommunicator

comm = MPICommunicator()
pipe = deepreduce.build({"sparsifier": {"id": "topk", "ratio": 0.01 * (comm.rank + 1)}, "index": "raw",
                         "value": "raw", "memory": "none", "min_numel": 0})
grad = np.full((1000,), comm.rank + 1, dtype=np.float32)
parts = comm.allgather(pipe.encode(grad, name="g", step=1), "g")
sizes = [deepreduce.inspect(p)["n"] for p in parts]
assert sizes == [10 * (r + 1) for r in range(comm.size)], sizes
total = pipe.decode_sum(parts, expected_shape=(1000,))
assert total.sum() == sum((r + 1) * 10 * (r + 1) for r in range(comm.size))
print(f"OK {comm.rank}", flush=True)
