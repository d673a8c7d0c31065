"""Where one step of the torch device path spends its time: a torch.profiler table (host and
device time per op) and a cProfile table (Python functions) of ``bench-step``'s step for a
config on a gradient set, on any device (``--device cuda`` on a GPU; ``cpu`` takes the device path
on CPU tensors, for trying the script).

    python scripts/gpu_profile.py --device cuda --sets resnet50_flat configs/topk_raw.yaml
    python scripts/gpu_profile.py --device cuda --sets resnet50 --bucket-mb 25 configs/topk_raw.yaml
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats

from torch.profiler import ProfilerActivity, profile

from experiments.cli import bench_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--sets", default="resnet50_flat", choices=bench_step.SETS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--bucket-mb", type=float, default=None)
    parser.add_argument("--rows", type=int, default=25, help="rows of each table")
    args = parser.parse_args()
    (_, load), = bench_step.gradient_sets(argparse.Namespace(sets=args.sets, gradients=None, seed=0))
    grads = load()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    for path in args.configs:
        runner = bench_step.ConfigRunner(path, grads, ranks=2, threads=1, device=args.device, bucket_mb=args.bucket_mb)
        for _ in range(2):
            runner.step()
        encode, decode, sent = runner.step()
        print(f"=== {runner.method} on {args.sets}: encode {encode * 1e3:.2f} ms, decode {decode * 1e3:.2f} ms, {sent:,} bytes")
        with profile(activities=activities) as prof:
            runner.step()
        sort = "self_cuda_time_total" if len(activities) > 1 else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        if len(activities) > 1:
            print(prof.key_averages().table(sort_by=sort, row_limit=args.rows))
        profiler = cProfile.Profile()
        profiler.enable()
        runner.step()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.rows)
        print(text.getvalue())
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.rows)
        print(text.getvalue())


if __name__ == "__main__":
    main()
