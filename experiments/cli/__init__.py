"""Sub-commands of the ``deepreduce`` command line that belong to the harness (benchmarks,
reproductions, gradient capture): each module defines ``register(subparsers)``, found by
``deepreduce.cli`` when this package is importable."""
