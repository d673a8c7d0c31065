"""Turn a hung rank into a failure that shows where it hung.

``arm(seconds)`` makes the rank print every thread's stack to stderr and exit (code 1) when it
runs longer than ``seconds`` (``faulthandler.dump_traceback_later``), as PyTorch's multi-process
tests do; the launching test then fails with the ranks' output, stacks included, instead of
waiting forever.
"""
import faulthandler
import sys


def arm(seconds: float) -> None:
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)


def disarm() -> None:
    faulthandler.cancel_dump_traceback_later()
