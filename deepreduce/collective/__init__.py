"""What ranks do together, framework-free: agreement on model and compressor before the first
collective, buckets of gradients, encode-behind-backward bookkeeping (``overlap``) and the
communicators that carry containers between ranks (``comm``: Horovod, torch.distributed, MPI)."""
