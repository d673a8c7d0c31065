"""CPU time of a Bloom index's scan: one container decoded through the torch host and device paths.

The receiver of a Bloom container queries every position of the tensor the header claims, so a
container of a few hundred bytes claiming ``2**26`` elements costs a scan of ``2**26``
positions (decoded without an expected shape; ``max_numel`` bounds the claim). Each case runs
in a fresh child process (imports not counted) and prints the decode's wall and CPU seconds
(the CPU time of every thread of the child: torch's intra-op threads included)::

    .venv/bin/python scripts/bench_bloom_scan.py [--numel 67108864] [--profile]

Cases: an empty filter of the blocked family (format v2, what encoders write) and of the
SplitMix64 family (format v1, decoded only), policy P0, no values. ``--profile`` prints the
ten most expensive functions of each decode (cProfile, by own time).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import cProfile, io, os, pstats, struct, sys, time, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import numpy as np, torch
import deepreduce, hostile
from deepreduce.torch.pipeline import build
family, path, numel, profile = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
if family == "splitmix":
    _, base = hostile.valid_container(os.path.join(hostile.ROOT, "configs", "bf_p2.yaml"))
    payload = hostile.rewrite(base, shape=(numel,), n=0, index_params=struct.pack("<BBQQQ", 1, 7, 64, 0, 0),
                              index_section=bytes(8), value_section=b"").tobytes()
else:
    payload = hostile.bloom_container("p0", 2, 1, 0, numel, fill=0)
pipe = build(deepreduce.build(hostile.RECEIVER), path)
tensor = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy())
prof = cProfile.Profile() if profile else None
wall, cpu = time.perf_counter(), time.process_time()
if prof:
    prof.enable()
out = pipe.decode(tensor)
if prof:
    prof.disable()
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print(f"{family:8s} {path:6s} {tuple(out.shape)}: wall {wall:.2f} s, CPU {cpu:.2f} s")
if prof:
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(10)
    print(text.getvalue())
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 26)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    for family in ("blocked", "splitmix"):
        for path in ("host", "device"):
            subprocess.run([sys.executable, "-c", CHILD, ROOT, family, path, str(args.numel),
                            "1" if args.profile else "0"], check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))


if __name__ == "__main__":
    main()
