"""Worker: with Top-r, the bytes each rank receives equal the documented container sizes.

Every rank allgathers a Top-r container of a (64, 64, 3, 3) tensor; the gathered buffer must hold
size * (35 + 8r) bytes, r = floor(0.01 * 36,864) = 368 (docs/container-format.md).
"""
import horovod.torch as hvd
import numpy as np
import torch

import deepreduce
from deepreduce.collective.comm.horovod import HorovodCommunicator
from deepreduce.wire import container

hvd.init()
pipe = deepreduce.build("configs/topk_raw.yaml")
grad = np.random.default_rng(hvd.rank()).standard_normal((64, 64, 3, 3)).astype(np.float32)
payload = pipe.encode(grad, name="conv", step=0)
r = 368
expected = container.overhead(grad.shape, r, 4 * r, 4 * r) + 4 * r + 4 * r
assert payload.size == expected == 35 + 8 * r, payload.size
gathered = hvd.allgather(torch.from_numpy(payload), name="raw_bytes")
assert gathered.numel() == hvd.size() * expected, gathered.numel()
parts = HorovodCommunicator().allgather(payload, "via_communicator")
assert [p.size for p in parts] == [expected] * hvd.size()
total = pipe.decode_sum(parts, expected_shape=grad.shape)
assert np.count_nonzero(total) <= hvd.size() * r
print(f"OK {hvd.rank()} {gathered.numel()}", flush=True)
