"""Example: the main job under PyTorch DistributedDataParallel and torchrun (see experiments/train.py).

The model, data, sharding, optimizer and per-epoch line are the Horovod job's; only the gradient
exchange differs: a DDP communication hook.

    torchrun --nproc_per_node 2 examples/train_ddp.py --config bf_p2   # deepreduce's hook
    torchrun --nproc_per_node 2 examples/train_ddp.py --hook powersgd               # PyTorch's PowerSGD (rank 4)
    torchrun --nproc_per_node 2 examples/train_ddp.py --hook fp16                   # PyTorch's fp16 hook
    torchrun --nproc_per_node 2 examples/train_ddp.py --baseline                    # DDP's own allreduce

Across hosts (run on every host; HOST0 is any host the others reach):

    torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
        --rdzv-id digits examples/train_ddp.py --config bf_p2

Relative volume: deepreduce counts its containers' bytes, fp16 2 bytes an element, PowerSGD the
elements its factors (and the tensors it leaves uncompressed) send, the baseline 1.
"""
from experiments.train import main

if __name__ == "__main__":
    raise SystemExit(main())
