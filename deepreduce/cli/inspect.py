"""``deepreduce inspect FILE``: print the header of a saved container."""
from __future__ import annotations

import json

import numpy as np


def register(subparsers) -> None:
    parser = subparsers.add_parser("inspect", help="print the header of a container file")
    parser.add_argument("path", help="a file holding one container (raw bytes)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ..wire.container import inspect

    payload = np.fromfile(args.path, dtype=np.uint8)
    print(json.dumps(inspect(payload), indent=2, default=list))
    return 0
