"""The experiment harness, NOT part of the library (not in the wheel): the main training job,
models, data sets and captured gradients, the paper reproductions and the ``bench-*`` commands.

It imports ``deepreduce``; the library never imports it. ``make setup`` puts the checkout on the
venv's path and installs scripts/harness/, whose entry point (group ``deepreduce.commands``)
hands the commands of ``experiments.cli`` to the ``deepreduce`` command line.
"""
