"""The experiment harness, NOT part of the library (not in the wheel): the main training job,
models, data sets and captured gradients, the paper reproductions and the ``bench-*`` commands.

It imports ``deepreduce``; the library never imports it. The ``deepreduce`` command line finds
the commands of ``experiments.cli`` when this package is importable (a source checkout set up by
``make setup``, which puts the checkout on the venv's path).
"""
