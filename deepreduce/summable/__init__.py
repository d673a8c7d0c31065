"""Compressors whose outputs add up, so they travel by all-reduce instead of allgather
(GradiVeQ's PCA vector quantisation; the framework adapters live in the bindings)."""
